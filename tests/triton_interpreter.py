"""Triton's CPU interpreter with its per-call set-up done once: the same semantics, about a third less time.

The interpreter (triton/runtime/interpreter.py) swaps triton.language's builtins for interpreting versions before
each kernel launch and puts them back after. Two costs repeat that need not:
- every launch lists each language module's members with `inspect.getmembers` to find the builtins, and the list
  never changes: here it is made once per module (while the module is unpatched, as a launch always finds it);
- every call of a `@triton.jit` helper from inside a kernel (each program instance calls them) patches the language
  again, although the launch around it already did for the same modules (or an earlier helper call did, for good:
  the interpreter never undoes a helper's patches): here such a call runs the helper at once when every language
  module it sees is patched already (the first call of a helper that sees another takes the interpreter's way).
Together they were ~30 % of the interpreter's time in the engine's Triton-path tests (py-spy). What the kernels
compute is untouched: the same interpreting builtins wrap the same originals. If the interpreter's internals are
not the ones this was written against, nothing is changed.
"""

from __future__ import annotations

import functools
import inspect


def install() -> bool:
    """Speeds up the interpreter in this process; False (and nothing changed) where its internals differ."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter as ti
    except ImportError:
        return False
    needed = ("_patch_builtin", "_patch_attr", "_patch_lang", "GridExecutor", "InterpretedFunction", "InterpreterError")
    if getattr(ti, "_bulkgen_fast", False) or not all(hasattr(ti, name) for name in needed):
        return False
    if list(inspect.signature(ti._patch_builtin).parameters) != ["pkg", "builder", "scope"]:
        return False
    builtins: dict[int, list] = {}

    def patch_builtin(pkg, builder, scope) -> None:
        found = builtins.get(id(pkg))
        if found is None:
            found = builtins[id(pkg)] = [(name, member) for name, member in inspect.getmembers(pkg)
                                         if tl.core.is_builtin(member)]
        for name, member in found:
            ti._patch_attr(pkg, name, member, builder, scope)

    @functools.cache
    def langs(fn) -> frozenset:
        return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))

    patched: list[frozenset] = []  # the language modules each running launch patched (innermost last)
    # modules a helper's own call patched: the interpreter never undoes those patches (a launch undoes its own only),
    # so they stay patched for good (triton.language.core, seen by the library's helpers such as tl.sum's)
    kept: set = set()
    launch = ti.GridExecutor.__call__
    device_call = ti.InterpretedFunction.__call__

    @functools.wraps(launch)
    def grid_call(self, *args, **kwargs):
        patched.append(langs(self.fn))
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.pop()

    @functools.wraps(device_call)
    def helper_call(self, *args, **kwargs):
        if not patched or not langs(self.fn) <= patched[-1] | kept:
            result = device_call(self, *args, **kwargs)
            kept.update(langs(self.fn))
            return result
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # as the interpreter reports it
            raise ti.InterpreterError(repr(e)) from e

    ti._patch_builtin = patch_builtin
    ti.GridExecutor.__call__ = grid_call
    ti.InterpretedFunction.__call__ = helper_call
    ti._bulkgen_fast = True
    return True
