"""The ONNX front end's settings from the environment: how much it folds at import, how long a
Loop may run, how large ``polyhal run``'s input files may be, where checked models are kept (each
read where it is used)."""

from __future__ import annotations

from dataclasses import dataclass

from polyhal.config import Integer, Settings, Size, Text, setting

__all__ = ["FOLD_LIMIT", "LOOP_LIMIT", "SESSION_CACHE", "OnnxSettings"]

#: Largest result (bytes) an op may produce by folding at import: above it the op stays in the
#: program and runs on a device, so a tiny model cannot make the import itself take gigabytes
#: (``ConstantOfShape([2**29]) -> ReduceSum``). Shape computations must fold: keep it above a few KiB.
FOLD_LIMIT = 32 << 20
#: Most iterations one Loop node runs, so a corrupt or hostile trip count fails clearly.
LOOP_LIMIT = 1_000_000
#: Compiled static models an InferenceSession keeps per process for later sessions of the same
#: model: each holds its program's weights (on the host), so the bound is memory.
SESSION_CACHE = 8


@dataclass(frozen=True)
class OnnxSettings(Settings, component="ONNX front end"):
    """The limits the ONNX front end reads from the environment."""

    fold_limit: int = setting("POLYHAL_FOLD_LIMIT", Size(), FOLD_LIMIT,
                              "largest result an op may fold to at import (load(..., fold_limit=) wins)")
    loop_limit: int = setting("POLYHAL_LOOP_LIMIT", Integer(low=0), LOOP_LIMIT,
                              "most iterations one ONNX Loop node runs")
    input_limit: int | None = setting(
        "POLYHAL_INPUT_LIMIT", Size(), None,
        "most bytes the --input files of polyhal run may expand to in all",
        shown="the memory the process may use")
    session_cache: int = setting(
        "POLYHAL_SESSION_CACHE", Integer(low=0), SESSION_CACHE,
        "compiled static ONNX models an InferenceSession keeps per process, so that another session of the same "
        "model (same bytes, devices, options and environment) binds that compile again instead of importing and "
        "compiling it (0: off)")
    cache_dir: str = setting("POLYHAL_ONNX_CACHE_DIR", Text(), "",
                             "folder of the models ONNX's checker accepted, kept so that a later process does not "
                             "check them again (off, 0 or none: check every model in every process)",
                             shown="the per-user cache folder")
