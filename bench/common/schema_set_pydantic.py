"""Schemas as pydantic generates them, from models an app would pass to `parse(response_format=Model)`.

These carry pydantic's own shapes: `title` everywhere, nested models under `$defs` and
`$ref`, `Optional` as `anyOf` with null and a `default`, `Enum` classes, `Literal` as
`const` or `enum`, discriminated unions (`oneOf` with a `discriminator`), recursive models,
tuples (`prefixItems`), sets (`uniqueItems`), dicts (`additionalProperties`) and `Field`
bounds. Each example is a model instance dumped in JSON mode, so its keys follow the fields.
"""

from __future__ import annotations

import datetime
import enum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from common.schema_set_api import Entry


class Role(str, enum.Enum):
    admin = "admin"
    editor = "editor"
    viewer = "viewer"


class User(BaseModel):
    id: int = Field(ge=1)
    username: str = Field(pattern=r"^[a-z0-9_]{3,20}$")
    display_name: str | None = None
    role: Role
    active: bool = True


class Address(BaseModel):
    street: str
    city: str
    postal_code: str
    country: str = Field(min_length=2, max_length=2)


class OrderItem(BaseModel):
    sku: str
    quantity: int = Field(ge=1, le=100)
    unit_price: float = Field(ge=0)


class OrderStatus(str, enum.Enum):
    pending = "pending"
    paid = "paid"
    shipped = "shipped"
    delivered = "delivered"
    cancelled = "cancelled"


class Order(BaseModel):
    order_id: str
    customer: User
    items: list[OrderItem] = Field(min_length=1)
    shipping_address: Address
    billing_address: Address | None = None
    status: OrderStatus
    discount_code: str | None = None


class Appointment(BaseModel):
    title: str
    starts_at: datetime.datetime
    day: datetime.date
    duration_minutes: int = Field(gt=0, le=480)
    kind: Literal["in_person", "video", "phone"]


class Ticket(BaseModel):
    """Create a support ticket."""

    kind: Literal["ticket"]
    summary: Annotated[str, Field(min_length=5, max_length=120)]
    priority: Literal["p0", "p1", "p2", "p3"] = "p2"
    tags: list[str] = Field(default_factory=list, max_length=5)
    customer_email: str | None = None


class Cat(BaseModel):
    pet_type: Literal["cat"]
    indoor: bool
    lives_left: int = Field(ge=0, le=9)


class Dog(BaseModel):
    pet_type: Literal["dog"]
    breed: str
    good_with_kids: bool


class Parrot(BaseModel):
    pet_type: Literal["parrot"]
    vocabulary: list[str]


class PetOwner(BaseModel):
    owner: str
    pets: list[Annotated[Cat | Dog | Parrot, Field(discriminator="pet_type")]]


class TreeNode(BaseModel):
    label: str
    weight: float | None = None
    children: list[TreeNode] = Field(default_factory=list)


class MovieReview(BaseModel):
    movie: str
    year: int = Field(ge=1888, le=2100)
    rating: int = Field(ge=1, le=10, description="1 is worst, 10 is best")
    review: str = Field(min_length=10, max_length=1000)
    genres: list[Literal["action", "comedy", "drama", "horror", "sci-fi", "documentary", "animation"]]
    would_recommend: bool


class Employee(BaseModel):
    name: str
    title: str
    salary_band: Literal[1, 2, 3, 4, 5]
    manager: str | None = None


class Company(BaseModel):
    name: str
    founded: int
    headquarters: Address | None = None
    employees: list[Employee]
    headcount_by_office: dict[str, int]


class Entity(BaseModel):
    text: str
    label: Literal["PERSON", "ORG", "PRODUCT", "EVENT"]
    salience: float = Field(ge=0, le=1)


class ExtractionResult(BaseModel):
    entities: list[Entity]
    language: str = Field(pattern="^[a-z]{2}(-[A-Z]{2})?$")
    metadata: dict[str, str] | None = None


class Location(BaseModel):
    name: str
    lat_lon: tuple[float, float]
    tags: set[str]


class Measurement(BaseModel):
    sensor: str
    value: int | float | str
    readings: list[int] | None = None
    unit: Literal["celsius"] = "celsius"


class ChainOfThought(BaseModel):
    reasoning: list[str] = Field(description="Short steps, in order")
    answer: Literal["A", "B", "C", "D"]
    confidence: float = Field(ge=0, le=1)


def _entry(name: str, model: BaseModel) -> Entry:
    schema: dict[str, Any] = type(model).model_json_schema()
    return name, schema, model.model_dump(mode="json")


def pydantic_schemas() -> list[Entry]:
    address = Address(street="1600 Amphitheatre Pkwy", city="Mountain View", postal_code="94043", country="US")
    user = User(id=7, username="ada_l", display_name="Ada L.", role=Role.editor)
    order = Order(
        order_id="A-1009",
        customer=user,
        items=[OrderItem(sku="BK-1", quantity=2, unit_price=12.5), OrderItem(sku="PN-7", quantity=1, unit_price=3.0)],
        shipping_address=address,
        status=OrderStatus.paid,
    )
    tree = TreeNode(
        label="root", children=[TreeNode(label="a", weight=0.5), TreeNode(label="b", children=[TreeNode(label="b1")])]
    )
    company = Company(
        name="Kestrel Labs",
        founded=2014,
        headquarters=address,
        employees=[
            Employee(name="Jo", title="CTO", salary_band=5),
            Employee(name="Sam", title="SRE", salary_band=3, manager="Jo"),
        ],
        headcount_by_office={"berlin": 40, "austin": 12},
    )
    return [
        _entry("pyd_user", user),
        _entry("pyd_order", order),
        _entry(
            "pyd_appointment",
            Appointment(
                title="Dentist",
                starts_at=datetime.datetime(2025, 3, 3, 9, 30, tzinfo=datetime.timezone.utc),
                day=datetime.date(2025, 3, 3),
                duration_minutes=45,
                kind="in_person",
            ),
        ),
        _entry("pyd_ticket_literal_const", Ticket(kind="ticket", summary="Cannot reset password", tags=["auth"])),
        _entry(
            "pyd_discriminated_union",
            PetOwner(
                owner="Noor",
                pets=[
                    Cat(pet_type="cat", indoor=True, lives_left=9),
                    Dog(pet_type="dog", breed="Collie", good_with_kids=True),
                    Parrot(pet_type="parrot", vocabulary=["hello", "cracker"]),
                ],
            ),
        ),
        _entry("pyd_recursive_tree", tree),
        _entry(
            "pyd_movie_review",
            MovieReview(
                movie="Arrival",
                year=2016,
                rating=9,
                review="Quiet, patient and moving; the linguistics are handled with care.",
                genres=["sci-fi", "drama"],
                would_recommend=True,
            ),
        ),
        _entry("pyd_company", company),
        _entry(
            "pyd_extraction_result",
            ExtractionResult(
                entities=[
                    Entity(text="Apple", label="ORG", salience=0.8),
                    Entity(text="WWDC", label="EVENT", salience=0.4),
                ],
                language="en-US",
            ),
        ),
        _entry("pyd_tuple_set", Location(name="Lisbon", lat_lon=(38.7223, -9.1393), tags={"coast"})),
        _entry("pyd_unions_optional", Measurement(sensor="t-01", value=21.5, readings=[21, 22, 21])),
        _entry(
            "pyd_chain_of_thought",
            ChainOfThought(
                reasoning=["Options B and D contradict the text.", "A is too narrow."], answer="C", confidence=0.7
            ),
        ),
    ]
