"""What every request body shares: text without lone surrogates, and lenient models
(unknown fields ignored, null meaning unset). Only pydantic is imported here."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, model_validator


def no_lone_surrogates(text: str) -> str:
    # JSON's \ud800 escapes decode to halves of UTF-16 pairs that no UTF-8 text holds;
    # the tokenizer would refuse them with a TypeError deep inside. Encoding finds the
    # first one faster than a regular expression would.
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(
            f"the text holds a lone UTF-16 surrogate (U+{ord(text[error.start]):04X}) at character {error.start}, "
            "which is not a Unicode character"
        ) from None
    return text


# Every string a client sends is checked: each one reaches a tokenizer or a JSON answer.
Text = Annotated[str, AfterValidator(no_lone_surrogates)]


class Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        # OpenAI's schema lets clients send null for any optional field; it means "unset".
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data
