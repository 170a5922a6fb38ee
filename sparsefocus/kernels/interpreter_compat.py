"""Make Triton's CPU interpreter (TRITON_INTERPRET=1) run the package's kernels as the GPU does.

* NumPy >= 2: the interpreter stores scalars as one-element arrays and converts them with
  ``int(array)`` for ``range(0, n, step)`` loop bounds, which NumPy 2 refuses for a 1-d array.
  We wrap the interpreter's tensor patching so that ``__index__`` reads the single element.
* Triton 3.9: a comparison of a scalar can carry the int32 type in its interpreter handle, and
  the interpreter broadcasts a scalar into a block with the scalar's type instead of the block's,
  so ``flag | mask`` became an int32 array that ``tl.store`` then refuses as a mask ("mask has
  unsupported dtype"). We make the broadcast take the block's element type, as compiled code does.
* The interpreter redoes every int32 add, subtract and multiply in int64 to check it for
  overflow, and then, outside debug mode, discards the check (``device_assert`` is a no-op
  there). That dead work took about a third of an interpreted kernel's time; we turn it off.

Does nothing when the interpreter is not in use.
"""

from __future__ import annotations

import dataclasses
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


def patch_interpreter_splat() -> None:
    """Idempotently give a scalar broadcast into a block the block's element type."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_splat
    if getattr(original, "_sparsefocus_patched", False):
        return

    def create_splat(self, ret_ty, arg):
        handle = original(self, ret_ty, arg)
        want = interpreter._get_np_dtype(ret_ty)
        if handle.data.dtype == want and handle.dtype == ret_ty.scalar:
            return handle
        return interpreter.TensorHandle(handle.data.astype(want), ret_ty.scalar)

    create_splat._sparsefocus_patched = True
    builder.create_splat = create_splat


def patch_interpreter_overflow_checks() -> None:
    """Skip the interpreter's int32 overflow checks when, outside debug mode, it would discard them."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    from triton.runtime import interpreter

    builder = getattr(interpreter, "interpreter_builder", None)
    if builder is not None and getattr(builder.options, "sanitize_overflow", False) and not builder.options.debug:
        builder.options = dataclasses.replace(builder.options, sanitize_overflow=False)


patch_interpreter_index()
patch_interpreter_splat()
patch_interpreter_overflow_checks()
