"""Triton, or a stand-in that names the missing package when a kernel is launched.

Triton is an optional dependency (the ``triton`` extra): the pure-PyTorch path (``backend="torch"``, what ``auto``
picks on the CPU) never launches a kernel, so ``import mxlib``, the reference functions, the experts on the CPU,
calibration, the writer, the loader and the inspector all run without it. Every kernel module imports ``triton`` and
``tl`` from here. Without Triton installed they are ``Missing`` stand-ins: decorating, module-level constants and
annotations (``@triton.jit``, ``tl.constexpr(...)``, ``tl.float32``) go through, and launching a kernel, or calling
any other Triton function, raises ``ImportError`` naming ``pip install "mxlib[triton]"``.
"""

from __future__ import annotations

__all__ = ["HAVE_TRITON", "Missing", "triton", "tl"]

_HINT = (
    'mxlib\'s Triton kernels need the triton package, which is not installed: pip install "mxlib[triton]" (the '
    "pure-PyTorch path, backend='torch', runs without it)"
)


class Missing:
    """A stand-in for a Triton object: attributes are stand-ins too; decorating a function gives a stand-in
    kernel; launching it (``kernel[grid](...)`` or a call) raises ``ImportError`` naming the missing package."""

    def __init__(self, name: str, fn=None):
        self._name, self._fn = name, fn

    def __getattr__(self, attr: str) -> Missing:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Missing(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        if self._fn is not None:
            raise ImportError(f"{self._name}: {_HINT}")
        if len(args) == 1 and callable(args[0]) and not kwargs and not isinstance(args[0], Missing):
            return Missing(f"{getattr(args[0], '__name__', 'kernel')}", fn=args[0])  # @triton.jit
        if self._name.endswith((".jit", ".autotune", ".heuristics")):
            return self  # @triton.jit(...) with options: a decorator again
        if self._name.endswith(".constexpr"):
            return args[0] if args else None  # tl.constexpr(value): the value
        raise ImportError(f"{self._name}: {_HINT}")

    def __getitem__(self, grid) -> Missing:
        return Missing(self._name, fn=self._fn or (lambda *a, **k: None))

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"<{self._name}: triton is not installed>"


try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False
    triton = Missing("triton")
    tl = Missing("triton.language")
