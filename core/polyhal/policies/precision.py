"""The precision policy: which precisions a compile may ask for, where the default comes from,
and which device capability each needs. The pass that applies it is
:mod:`polyhal.passes.precision` (its docstring says what each precision does)."""

from __future__ import annotations

from dataclasses import dataclass

from polyhal.config import Choice, Settings, setting
from polyhal.errors import PrecisionError

__all__ = ["CAPABILITY", "ENV", "PRECISIONS", "PrecisionSettings", "resolve_precision"]

#: The environment variable giving the precision of compiles that do not pass one.
ENV = "POLYHAL_PRECISION"
#: Precision name -> what it means, as messages and explain say it.
PRECISIONS = {
    "fp32": "float32 computes in float32",
    "tf32": "float32 contractions may use TF32 tensor cores",
    "fp16": "float32 compute runs in float16 where safe",
}


@dataclass(frozen=True)
class PrecisionSettings(Settings, component="precision"):
    """The precision of compiles that pass none (read at each compile)."""

    precision: str | None = setting(
        ENV, Choice(*PRECISIONS), None,
        "how float32 work of compiles without precision= may compute: "
        + "; ".join(f"{k}: {v}" for k, v in PRECISIONS.items()), shown="fp32",
        hint="bf16 is storage-only (no device computes in it); unset it for fp32")


#: The device capability (``DeviceSpec.capabilities`` tag) each precision needs.
CAPABILITY = {"fp32": "", "tf32": "tf32", "fp16": "fp16"}


def resolve_precision(precision: str | None) -> tuple[str, str]:
    """``(precision, where it came from)``: ``precision`` itself (``"precision="``), else
    ``POLYHAL_PRECISION`` (``"POLYHAL_PRECISION"``), else ``"fp32"`` (``"default"``). An unknown
    name, or ``"bf16"``, is a :class:`~polyhal.errors.PrecisionError` (in the variable: a
    :class:`~polyhal.errors.ConfigError`)."""
    if precision is None:
        env = PrecisionSettings.from_env().precision
        return (env, ENV) if env else ("fp32", "default")
    name = precision.lower() if isinstance(precision, str) else precision
    where = f"precision={precision!r}"
    if name not in PRECISIONS and name != "bf16":
        raise PrecisionError(f"{where} is not a precision; use one of {', '.join(PRECISIONS)} ("
                             + "; ".join(f"{k}: {v}" for k, v in PRECISIONS.items()) + ")")
    if name == "bf16":
        raise PrecisionError(f"{where}: no device computes in bfloat16: polyhal's op set holds it as a "
                             "storage-only type (arithmetic needs a 'cast' to a compute type first); use "
                             "'fp16' (float16 compute, float32 accumulation) or 'tf32'")
    return name, "precision="
