"""Hook calls through pluggy that also say which plugin answered.

polyhal calls every hook through pluggy (``pm.hook.<name>(...)``), so that the standard pluggy
tools work for users as they do in pytest: ``@hookimpl(wrapper=True)`` and old-style
``hookwrapper=True`` implementations see and may change an answer, ``tryfirst`` / ``trylast``
order the implementations, ``pm.add_hookcall_monitoring`` traces every call and
``pm.subset_hook_caller`` leaves plugins out.

What pluggy does not tell is *who* answered, which ``polyhal explain`` and every error message
need. :class:`PluginManager` records it: when a plugin is registered, each of its hook
implementations is given a thin recording layer (pluggy still calls it, in its own order), and
:meth:`PluginManager.first_answer` / :meth:`PluginManager.each_answer` read what was recorded
during their call. The layer costs one Python call per implementation per hook call; hooks are
called at compile time and device creation only, never while a plan runs.

pluggy has no public way to see each implementation's answer: ``add_hookcall_monitoring`` and
tracing see a whole call, and a wrapper sees only the final answer. So the layer is set as the
``HookImpl.function`` that pluggy calls (typed ``Final`` there, a plain slot at run time), and
wrappers are driven step by step as pluggy drives them. Both hold for pluggy 1.5 to 1.7;
pyproject.toml pins ``pluggy>=1.5,<2``, tests/test_hookcall.py checks what the layer relies on,
and .ci/run runs that file against pluggy's newest release too, so that a release that breaks
it is seen before the pin is lifted.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, NamedTuple, Sequence

import pluggy

from polyhal.errors import PluginError

#: Hooks whose implementations are called for every plugin and whose answers are collected
#: (registration): one failing plugin is recorded and skipped instead of failing the call.
COLLECTED_HOOKS = frozenset({"register_devices", "report_unavailable", "register_passes"})


class HookAnswer(NamedTuple):
    """The result of a firstresult hook call, with who gave it.

    ``plugin`` is the plugin whose answer stands: a hook wrapper that changed the answer, else the
    implementation that returned it (``None`` when nobody answered). ``answered`` is always the
    implementation that returned the first non-``None`` value, before any wrapper.
    """

    value: Any
    plugin: str | None
    answered: str | None

    @property
    def changed_by_wrapper(self) -> bool:
        """Whether a hook wrapper replaced the answer of the implementation that gave it."""
        return self.plugin is not None and self.plugin != self.answered


class _Call:
    """What the recording layers saw during one hook call made by this module."""

    __slots__ = ("hook", "collect", "value", "plugin", "answered", "raised", "answers", "failures")

    def __init__(self, hook: str, collect: bool) -> None:
        self.hook, self.collect = hook, collect
        self.value: Any = None
        self.plugin: str | None = None
        self.answered: str | None = None
        self.raised: str | None = None
        self.answers: list[tuple[str, Any]] = []
        self.failures: list[tuple[str, Exception]] = []


class _Calls(threading.local):
    """Per thread: the calls being recorded, innermost last (a hook may call another)."""

    def __init__(self) -> None:
        self.stack: list[_Call] = []


_local = _Calls()


def _current(hook: str) -> _Call | None:
    """The call being recorded on this thread, when it is a call of ``hook``."""
    stack = _local.stack
    if stack:
        call = stack[-1]
        if call.hook == hook:
            return call
    return None


def _record_impl(hook: str, plugin: str, function: Callable[..., Any]) -> Callable[..., Any]:
    def recorded(*args: Any) -> Any:
        stack = _local.stack
        call = stack[-1] if stack else None
        if call is None or call.hook != hook:  # a direct pm.hook call: nothing to record
            return function(*args)
        try:
            value = function(*args)
            if call.collect and value is not None:
                value = list(value)  # a generator's errors surface here, inside the guard
        except Exception as exc:
            if call.collect:
                call.failures.append((plugin, exc))
                return None
            call.raised = plugin
            raise
        if value is not None:
            call.answers.append((plugin, value))
            call.value, call.plugin, call.answered = value, plugin, plugin
        return value

    return recorded


def _record_wrapper(hook: str, plugin: str, function: Callable[..., Any], old_style: bool) -> Callable[..., Any]:
    """A generator that runs the wrapper ``function`` step by step as pluggy would, and notes
    when the wrapper replaced the answer it was sent (new style: its return value; old style:
    ``outcome.force_result``)."""

    def recorded(*args: Any) -> Any:
        inner = function(*args)
        try:
            yielded = next(inner)
        except StopIteration as stop:  # pluggy reports a wrapper that did not yield
            return stop.value
        while True:
            try:
                sent = yield yielded
            except GeneratorExit:
                inner.close()
                raise
            except BaseException as exc:  # the call raised: the wrapper may handle it
                try:
                    yielded = inner.throw(exc)
                except StopIteration as stop:
                    _note_wrapper(hook, plugin, exc, stop.value)
                    return stop.value
                except BaseException as again:
                    if again is not exc:
                        _note_raise(hook, plugin)
                    raise
                continue
            before = sent
            if old_style:
                before = sent.get_result() if sent.exception is None else None
            try:
                yielded = inner.send(sent)
            except StopIteration as stop:
                after = stop.value
                if old_style:
                    after = sent.get_result() if sent.exception is None else None
                _note_wrapper(hook, plugin, before, after)
                return stop.value
            except BaseException:
                _note_raise(hook, plugin)
                raise

    return recorded


def _note_wrapper(hook: str, plugin: str, before: Any, after: Any) -> None:
    call = _current(hook)
    if call is not None and after is not before:
        call.value, call.plugin = after, plugin


def _note_raise(hook: str, plugin: str) -> None:
    call = _current(hook)
    if call is not None:
        call.raised = plugin


class PluginManager(pluggy.PluginManager):
    """pluggy's plugin manager, recording which plugin answered each hook call made through
    :meth:`first_answer` and :meth:`each_answer` (see the module docstring)."""

    def register(self, plugin: object, name: str | None = None) -> str | None:
        """Register ``plugin`` as pluggy does, then put the recording layer on its implementations."""
        registered = super().register(plugin, name)
        if registered is None:  # blocked
            return None
        for caller in self.get_hookcallers(plugin) or ():
            for impl in caller.get_hookimpls():
                if impl.plugin is plugin:
                    # HookImpl.function is what pluggy calls; argnames stay those of the plugin's function.
                    if impl.hookwrapper or impl.wrapper:
                        wrapped = _record_wrapper(caller.name, registered, impl.function, impl.hookwrapper)
                    else:
                        wrapped = _record_impl(caller.name, registered, impl.function)
                    impl.function = wrapped  # type: ignore[misc]
        return registered

    def first_answer(self, hook: str, *, where: str | Callable[[], str] = "", leave_out: Sequence[object] = (),
                     passthrough: tuple[type[BaseException], ...] = (), **kwargs: Any) -> HookAnswer:
        """Call the firstresult ``hook`` through pluggy; the answer and the plugin that gave it.

        ``leave_out``: plugins to leave out of this call (``pm.subset_hook_caller``). An exception
        from an implementation becomes a :class:`~polyhal.errors.PluginError` naming the plugin and
        ``where`` (e.g. ``"for cpu:0"``; a callable is called only then), except those of the
        ``passthrough`` types.
        """
        caller = self.subset_hook_caller(hook, leave_out) if leave_out else getattr(self.hook, hook)
        call = self._push(hook, collect=False)
        try:
            value = caller(**kwargs)
        except passthrough:
            raise
        except Exception as exc:
            who = f"plugin {call.raised!r}" if call.raised else "a plugin"
            where = where() if callable(where) else where
            raise PluginError(f"{who} raised in {hook}{' ' + where if where else ''}: "
                              f"{type(exc).__name__}: {exc}", plugin=call.raised) from exc
        finally:
            self._pop()
        plugin = call.plugin if value is not None and value is call.value else None
        return HookAnswer(value, plugin, call.answered)

    def each_answer(self, hook: str, *, leave_out: Sequence[object] = (),
                    **kwargs: Any) -> tuple[list[tuple[str, Any]], list[tuple[str, Exception]]]:
        """Call a collecting hook (:data:`COLLECTED_HOOKS`) through pluggy.

        Returns ``(answers, failures)``: ``(plugin, list of what it returned)`` in registration
        order, and ``(plugin, exception)`` for each implementation that raised; one failing
        plugin does not stop the others. ``leave_out`` as for :meth:`first_answer`.
        """
        caller = self.subset_hook_caller(hook, leave_out) if leave_out else getattr(self.hook, hook)
        call = self._push(hook, collect=True)
        try:
            results = caller(**kwargs)
        finally:
            self._pop()
        owner = {id(v): p for p, v in call.answers}
        fallback = call.plugin or "a hook wrapper"
        answers = [(owner.get(id(v), fallback), list(v)) for v in reversed(results)]
        return answers, list(call.failures)

    @staticmethod
    def _push(hook: str, *, collect: bool) -> _Call:
        if (hook in COLLECTED_HOOKS) != collect:
            right = "each_answer" if hook in COLLECTED_HOOKS else "first_answer"
            raise PluginError(f"hook {hook!r} is called with PluginManager.{right}")
        call = _Call(hook, collect)
        _local.stack.append(call)
        return call

    @staticmethod
    def _pop() -> None:
        _local.stack.pop()
