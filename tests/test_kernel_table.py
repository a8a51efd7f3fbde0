"""A backend's kernel table (polyhal.hal.kernels.KernelTable): kernel modules declared lazily
(register_lazily) are listed at once and imported at the first question about one of their ops."""

from __future__ import annotations

import sys
import textwrap

import numpy as np
import pytest

from polyhal import KernelTable, PluginError
from polyhal.ir.types import TensorType

T = TensorType((3,), np.float32)


@pytest.fixture
def modules(tmp_path, monkeypatch):
    """Write modules ``name -> source`` to a folder on sys.path; forgotten again afterwards."""
    monkeypatch.syspath_prepend(str(tmp_path))
    written = []

    def write(**sources: str) -> None:
        for name, source in sources.items():
            (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
            written.append(name)
    yield write
    for name in written:
        sys.modules.pop(name, None)


NEG = """
    import numpy as np
    from lazy_table import TABLE

    @TABLE.register("neg", "abs")
    def _build(device, op, attrs, ins, outs, scratch):
        ufunc = np.negative if op == "neg" else np.absolute
        return lambda x, out: ufunc(x, out=out)
"""


def test_a_lazy_module_is_listed_at_once_and_imported_at_its_first_prepare(modules):
    modules(lazy_table="from polyhal import KernelTable\nTABLE = KernelTable('lazydev')\n", lazy_neg=NEG)
    from lazy_table import TABLE

    TABLE.register_lazily("lazy_neg", ("neg", "abs"))
    assert {"neg", "abs"} <= TABLE.kernel_names and "lazy_neg" not in sys.modules
    assert TABLE.scratch(None, "exp", {}, (T,), (T,)) == () and "lazy_neg" not in sys.modules  # another op's
    kernel = TABLE.prepare(None, "neg", {}, (T,), (T,))
    assert "lazy_neg" in sys.modules and not TABLE.lazy
    out = np.empty(3, np.float32)
    kernel(np.array([1, -2, 3], np.float32), out)
    assert out.tolist() == [-1, 2, -3]
    assert TABLE.kernel_names == {"neg", "abs"}


def test_a_lazy_module_must_register_what_it_was_declared_to(modules):
    modules(lazy_table="from polyhal import KernelTable\nTABLE = KernelTable('lazydev')\n", lazy_neg=NEG)
    from lazy_table import TABLE

    TABLE.register_lazily("lazy_neg", ("neg", "abs", "exp"))
    with pytest.raises(PluginError, match=r"lazy_neg was declared to register the kernels of \['exp'\]"):
        TABLE.prepare(None, "neg", {}, (T,), (T,))


def test_an_op_declared_lazily_is_registered_by_its_module_alone(modules):
    modules(lazy_table="from polyhal import KernelTable\nTABLE = KernelTable('lazydev')\n", lazy_neg=NEG)
    from lazy_table import TABLE

    TABLE.register_lazily("elsewhere", ("neg",))
    with pytest.raises(PluginError, match="'neg' was declared to be registered by elsewhere"):
        __import__("lazy_neg")
    table = KernelTable("twice")
    table.register_lazily("one", ("neg",))
    with pytest.raises(PluginError, match="two kernels"):
        table.register_lazily("two", ("neg",))
    with pytest.raises(PluginError, match="no such op"):
        table.register_lazily("one", ("no_such_op",))


def test_a_module_imported_before_its_declaration_is_taken_as_it_registered(modules):
    modules(lazy_table="from polyhal import KernelTable\nTABLE = KernelTable('lazydev')\n", lazy_neg=NEG)
    import lazy_neg  # noqa: F401 -- (a script importing a kernel module by name first)
    from lazy_table import TABLE

    TABLE.register_lazily("lazy_neg", ("neg", "abs"))
    assert not TABLE.lazy and TABLE.kernel_names == {"neg", "abs"}
    with pytest.raises(PluginError, match="two kernels"):
        TABLE.register_lazily("another", ("neg",))
