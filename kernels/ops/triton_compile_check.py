# ruff: noqa: C408  (dict(...) reads better for kernel signatures)
"""Compile every triton kernel ahead of time for CUDA targets, without a GPU.

The interpreter (``TRITON_INTERPRET=1``) runs kernels as numpy and misses compile-only errors
(e.g. non-constexpr globals, type mismatches of loop-carried values); this lowers each kernel and
specialization we launch through triton's real pipeline to PTX (ptxas included), so a machine without
a GPU still proves the kernels build for sm_80/sm_90. Run:

    python -m adopter.kernels.ops.triton_compile_check --arch 80 --arch 90

Must run without ``TRITON_INTERPRET=1`` (``@triton.jit`` then builds interpreter objects instead).
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback

DTYPES = ("fp32", "fp16", "bf16")


def _cases(dt: str):
    from . import triton_bias_gelu as bg
    from . import triton_layer_norm as ln
    from . import triton_softmax as sm

    p, f32 = "*" + dt, "*fp32"
    ln_fwd = dict(X=p, R=p, W=p, B=p, Y=p, H=p, Mean=f32, Rstd=f32, N="i32", eps="fp32", p="fp32",
                  scale="fp32", Seed="*i64")
    ln_bwd = dict(DY=p, H=p, DHO=p, W=p, Mean=f32, Rstd=f32, DX=p, DR=p, DW=f32, DB=f32, M="i32", N="i32",
                  p="fp32", scale="fp32", Seed="*i64", rows_per_program="i32")
    return [
        (ln._dropout_add_layer_norm_fwd, ln_fwd,
         dict(HAS_DROPOUT=True, HAS_WEIGHT=True, HAS_BIAS=True, STORE_H=True, BLOCK_N=1024)),
        (ln._dropout_add_layer_norm_fwd, {**ln_fwd, "W": f32, "Y": f32},  # fp32 weight, autocast output
         dict(HAS_DROPOUT=False, HAS_WEIGHT=True, HAS_BIAS=False, STORE_H=False, BLOCK_N=32)),
        (ln._dropout_add_layer_norm_bwd, ln_bwd,
         dict(HAS_DROPOUT=True, HAS_WEIGHT=True, HAS_BIAS=True, NEED_DX=True, NEED_DR=True, HAS_DHO=False,
              BLOCK_N=1024)),
        # prenorm: the sum is an output too, its gradient is added
        (ln._dropout_add_layer_norm_bwd, ln_bwd,
         dict(HAS_DROPOUT=True, HAS_WEIGHT=True, HAS_BIAS=True, NEED_DX=True, NEED_DR=True, HAS_DHO=True,
              BLOCK_N=1024)),
        # half x with a float32 residual (autocast): float32 sum, output, weight and residual grad
        (ln._dropout_add_layer_norm_fwd, {**ln_fwd, "R": f32, "W": f32, "B": f32, "Y": f32, "H": f32},
         dict(HAS_DROPOUT=True, HAS_WEIGHT=True, HAS_BIAS=True, STORE_H=True, BLOCK_N=1024)),
        (ln._dropout_add_layer_norm_bwd, {**ln_bwd, "DY": f32, "H": f32, "DHO": f32, "W": f32, "DR": f32},
         dict(HAS_DROPOUT=True, HAS_WEIGHT=True, HAS_BIAS=True, NEED_DX=True, NEED_DR=True, HAS_DHO=True,
              BLOCK_N=1024)),
        (ln._dropout_add_layer_norm_bwd, ln_bwd,
         dict(HAS_DROPOUT=False, HAS_WEIGHT=False, HAS_BIAS=False, NEED_DX=True, NEED_DR=False, HAS_DHO=False,
              BLOCK_N=64)),
        (bg._bias_gelu_fwd, dict(Y=p, B=p, OUT=p, numel="i32", N="i32"),
         dict(HAS_BIAS=True, APPROX_TANH=False, BLOCK=1024)),
        (bg._bias_gelu_fwd, dict(Y=p, B=f32, OUT=p, numel="i64", N="i32"),
         dict(HAS_BIAS=True, APPROX_TANH=True, BLOCK=1024)),
        (bg._bias_gelu_bwd, dict(DOUT=p, Y=p, B=p, DZ=p, numel="i32", N="i32"),
         dict(HAS_BIAS=True, APPROX_TANH=False, BLOCK=1024)),
        (bg._bias_gelu_bwd, dict(DOUT=p, Y=p, B=p, DZ=p, numel="i32", N="i32"),
         dict(HAS_BIAS=False, APPROX_TANH=True, BLOCK=1024)),
        (sm._softmax_fwd, dict(X=p, Y=p, N="i32"), dict(BLOCK_N=128)),
        (sm._softmax_fwd, dict(X=p, Y=f32, N="i32"), dict(BLOCK_N=4096)),
        (sm._softmax_bwd, dict(DY=p, Y=p, DX=p, N="i32"), dict(BLOCK_N=128)),
    ]


def compile_all(archs, dtypes=DTYPES) -> list[str]:
    """Compile every case; returns the failures (empty when all kernels build)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    failures = []
    for arch in archs:
        target = GPUTarget("cuda", arch, 32)
        for dt in dtypes:
            for fn, types, consts in _cases(dt):
                names = fn.arg_names
                signature = {n: ("constexpr" if n in consts else types[n]) for n in names}
                constexprs = {(names.index(k),): v for k, v in consts.items()}
                try:
                    triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=target)
                except Exception as exc:  # noqa: BLE001  (report every failing kernel, not just the first)
                    tail = "".join(traceback.format_exception(exc))[-1500:]
                    failures.append(f"sm_{arch} {dt} {fn.__name__} {consts}:\n{tail}")
    return failures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", type=int, action="append", help="CUDA compute capability, e.g. 80, 90")
    parser.add_argument("--dtype", action="append", choices=DTYPES)
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("triton_compile_check: unset TRITON_INTERPRET (kernels would be interpreter objects)")
        return 2
    failures = compile_all(args.arch or [80, 90], tuple(args.dtype or DTYPES))
    for failure in failures:
        print(failure)
    print(f"triton_compile_check: {len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
