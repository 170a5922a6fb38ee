"""Make Triton's CPU interpreter (TRITON_INTERPRET=1) work with NumPy >= 2.

The interpreter stores scalars as one-element arrays and converts them with ``int(array)``
for ``range(0, n, step)`` loop bounds; NumPy 2 refuses ``int()`` of a 1-d array. We wrap the
interpreter's tensor patching so that ``__index__`` reads the single element instead. Does
nothing when the interpreter is not in use.
"""

from __future__ import annotations

import os


def patch_interpreter_index() -> None:
    """Idempotently fix ``tensor.__index__`` inside Triton's interpreter."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_sparsefocus_patched", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._sparsefocus_patched = True
    interpreter._patch_lang_tensor = patched


patch_interpreter_index()
