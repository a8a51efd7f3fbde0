"""The ``resolve_encoding`` policy as a compile asks it: one answer per (device, encoded type),
checked, with a failing plugin skipped for the decision (the built-in identity resolver decides
last). :class:`LayoutResolver` is part of the compile's :class:`~polyhal.target.Target`;
MaterializeEncoding (:mod:`polyhal.passes.materialize_encoding`) reads it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping

from polyhal.errors import PluginError
from polyhal.ir.encoding import IdentityLayout, Layout, dense_type
from polyhal.ir.types import TensorType

if TYPE_CHECKING:
    from polyhal.hal.records import DeviceSpec
    from polyhal.hookcall import PluginManager

__all__ = ["IDENTITY_RESOLVER", "LayoutResolver", "Resolution", "describe_encoding"]

#: Plugin name of the built-in identity resolver (registered by the registry, runs last).
IDENTITY_RESOLVER = "polyhal.policies.identity_encoding"


@dataclass(frozen=True)
class Resolution:
    """The layout one device gives one encoded tensor type, who chose it, and any fallback note."""

    device: str
    tensor_type: TensorType
    layout: Layout
    plugin: str
    note: str = ""


class LayoutResolver:
    """Calls ``resolve_encoding`` once per (device, encoded type) and checks what comes back."""

    def __init__(self, specs: Mapping[str, "DeviceSpec"], hooks: "PluginManager",
                 policy_answer: Callable[..., Any]) -> None:
        self._specs = specs
        self._hooks = hooks
        #: How the hook is asked: ``Registry.policy_answer`` (a plugin that fails is skipped with a
        #: warning, and the next one decides).
        self._policy = policy_answer
        self._memo: dict[tuple[str, TensorType], Resolution] = {}

    def resolve(self, device: str, tensor_type: TensorType) -> Resolution:
        """The resolution of ``tensor_type`` (identity for an unencoded type) on ``device``."""
        key = (device, tensor_type)
        found = self._memo.get(key)
        if found is None:
            found = self._memo[key] = self._compute(self._specs[device], tensor_type)
        return found

    def resolutions(self) -> list[Resolution]:
        """Every resolution made, in order (explain)."""
        return [r for r in self._memo.values() if r.tensor_type.encoding is not None]

    def _compute(self, spec: "DeviceSpec", t: TensorType) -> Resolution:
        encoding = t.encoding
        if encoding is None:
            return Resolution(spec.name, t, IdentityLayout(t), "")
        check = getattr(encoding, "check_type", None)
        if check is not None:
            check(dense_type(t))  # an encoding on a type it cannot describe fails here, clearly
        # A resolver that raises or returns a layout that does not fit is skipped, with a warning.
        answer = self._policy("resolve_encoding", where=lambda: f"for {encoding} on {spec.name}",
                              check=lambda a: _bad_layout(a.plugin, spec, t, a.value),
                              device=spec, encoding=encoding, tensor_type=t)
        layout, plugin = answer.value, answer.plugin
        if layout is None:
            raise PluginError("no resolve_encoding implementation returned a layout (is the identity resolver "
                              f"{IDENTITY_RESOLVER!r} unregistered?)")
        note = ""
        if plugin == IDENTITY_RESOLVER:
            has_own = any(i.plugin_name == spec.plugin for i in self._hooks.hook.resolve_encoding.get_hookimpls())
            note = (f"the resolver of plugin {spec.plugin!r} does not know {describe_encoding(encoding)}: identity "
                    "layout" if has_own else
                    f"plugin {spec.plugin!r} has no encoding resolver: identity layout")
        return Resolution(spec.name, t, layout, plugin, note)


def describe_encoding(encoding: Any) -> str:
    """How explain names an encoding (its ``describe()``, else ``str``)."""
    describe = getattr(encoding, "describe", None)
    return describe() if callable(describe) else str(encoding)


def _bad_layout(plugin: str | None, spec: "DeviceSpec", t: TensorType, layout: Any) -> str | None:
    """What is wrong with a resolve_encoding answer (None: a layout of ``t``)."""
    where = f"plugin {plugin!r} returned {layout!r} from resolve_encoding for {t} on {spec.name}"
    if not isinstance(layout, Layout):
        return (f"{where}; it must return a polyhal.ir.encoding.Layout (e.g. IdentityLayout(tensor_type) or a "
                "PackedLayout), or None to defer to the next resolver")
    lt = layout.tensor_type
    if not isinstance(lt, TensorType) or lt.shape != t.shape or lt.dtype != t.dtype:
        return f"{where}; the layout is for {lt}, not for the {t.shape} {t.dtype} tensor asked about"
    st = layout.storage_type
    if not isinstance(st, TensorType) or st.dtype != t.dtype or st.encoding is not None:
        return f"{where}; its storage_type {st!r} must be a dense {t.dtype} TensorType"
    if not layout.is_identity_layout() and (layout.pack_op() is None or layout.unpack_op() is None):
        return f"{where}; a layout that is not the identity must name its pack_op and unpack_op"
    return None
