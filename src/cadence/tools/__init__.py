"""Offline tools that produce artifacts for serving but are not part of it: GPTQ
calibration (``cadence quantize``). The serving import graph never imports this package."""
