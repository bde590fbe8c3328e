"""The kernels compile for an H100/H200 (sm_90) without a GPU: pipelined loads, no spills,
and the backend's prefill kernel really warp-specialized.

The interpreter checks what the kernels compute; this checks the compiled path it skips, with
the default launch configs at Qwen2.5-7B shapes. It runs in a subprocess without
``TRITON_INTERPRET`` (which decides, at import, whether kernels are compiled or interpreted)
and reads the register use from the cubin with the ``cuobjdump`` shipped with triton.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from edmm.kernels import triton_available

pytestmark = [pytest.mark.skipif(not triton_available(), reason="triton is not installed"),
              pytest.mark.slow]  # a subprocess compiling every kernel

SCRIPT = textwrap.dedent("""
    import json, os, subprocess, sys, tempfile
    import triton
    import triton.backends.nvidia as nv
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from edmm.kernels import DecodeConfig, PrefillConfig
    from edmm.kernels import _triton_decode as td, _triton_prefill as tp, _triton_rope as tr
    from edmm.kernels import _triton_skinny as tsk, _triton_silu as tsi, _triton_dequant as tdq
    from edmm.kernels._common import SkinnyConfig
    from edmm.model.attention_triton import PREFILL, PREFILL_FP8

    PTRS = {"q_ptr": "*bf16", "kv_ptr": "*bf16", "out_ptr": "*bf16", "slot_ids_ptr": "*i32",
            "ctx_lens_ptr": "*i32", "cu_q_ptr": "*i32", "part_o_ptr": "*fp32",
            "part_lse_ptr": "*fp32", "count_ptr": "*i32", "qk_scale": "fp32",
            "k_ptr": "*bf16", "v_ptr": "*bf16", "cos_ptr": "*bf16", "sin_ptr": "*bf16",
            "q_out_ptr": "*bf16", "slot_index_ptr": "*i64", "token_index_ptr": "*i64",
            "x_ptr": "*bf16", "w_ptr": "*bf16", "bias_ptr": "*bf16", "part_ptr": "*fp32",
            "kv_scale_ptr": "*fp32", "scale_ptr": "*fp32", "cu_ptr": "*i32"}
    FP8 = {"kv_ptr": "*fp8e4nv"}  # an FP8 KV cache (with its scales)
    CUOBJDUMP = os.path.join(os.path.dirname(nv.__file__), "bin", "cuobjdump")

    def compile_sm90(fn, constexprs, types=None, **options):
        names = fn.arg_names
        types = {**PTRS, **(types or {})}
        sig = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
        aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
                   if n not in constexprs and (n.endswith("_ptr") or n.startswith("stride"))}
        src = ASTSource(fn, sig, {(names.index(k),): v for k, v in constexprs.items()}, aligned)
        k = triton.compile(src, target=GPUTarget("cuda", 90, 64), options=options)
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(k.asm["cubin"])
            f.flush()
            usage = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True,
                                   text=True, check=True).stdout
        ptx = k.asm["ptx"]
        return {"cp_async": "cp.async" in ptx, "usage": usage, "shared": k.metadata.shared,
                "wgmma": "wgmma.mma_async" in ptx, "setmaxnreg": "setmaxnreg" in ptx,
                "atomic": "atom." in ptx, "griddepcontrol": "griddepcontrol.wait" in ptx,
                "trigger": "griddepcontrol.launch_dependents" in ptx,
                "trigger_first": 0 <= ptx.find("griddepcontrol.launch_dependents")
                                 < ptx.find("griddepcontrol.wait"),
                "prefetch": "prefetch.global.L2" in ptx,
                "tma": "cp.async.bulk.tensor" in ptx,
                "warps": k.metadata.num_warps}

    d, p, ws, sk = DecodeConfig(), PrefillConfig(), PREFILL, SkinnyConfig()
    fp8c = PREFILL_FP8  # the backend's FP8 prefill: the pipelined kernel
    ws8 = PrefillConfig(block_m=128, block_n=64, num_warps=4, num_stages=2, warp_specialize=True,
                        reverse=True)  # the warp-specialized kernel on FP8 (128-key tiles spill)
    split = dict(GROUP=7, GROUP_PAD=16, HEAD_DIM=128, SINGLE_SPLIT=False, DOT_PRECISION="tf32",
                 VARLEN=False, MERGE_G=8, LSE_S=64, BALANCED=False, TMA=False, FP8=False)
    out = {
        "decode": compile_sm90(
            td.decode_split_kernel,
            dict(split, BLOCK_N=d.block_n, FUSED=False, MERGE_S=1, PDL=False, EARLY=False,
                 PREFETCH=False, PREFETCH_TOKENS=0, ELEM_BYTES=2),
            num_warps=d.num_warps, num_stages=d.num_stages),
        **{name: compile_sm90(  # the fused merge, programmatic dependent launch, L2 prefetch
            td.decode_split_kernel,
            dict(split, BLOCK_N=block_n, FUSED=fused, MERGE_S=merge_s, PDL=True,
                 EARLY=tiles > 0, PREFETCH=True, PREFETCH_TOKENS=tiles * block_n,
                 ELEM_BYTES=2),
            num_warps=warps, num_stages=3, launch_pdl=True)
           for name, block_n, warps, merge_s, fused, tiles in (
               ("decode_fused", 32, 2, 2, True, 0), ("decode_fused_w8", 128, 8, 8, True, 1),
               ("decode_fused_w4", 64, 4, 4, True, 2),
               ("decode_pdl_prefetch", 64, 2, 1, False, 1))},
        **{name: compile_sm90(  # full tiles by TMA, the masked tail by pointers
            td.decode_split_kernel,
            dict(split, BLOCK_N=block_n, FUSED=False, MERGE_S=1, PDL=True, EARLY=False,
                 PREFETCH=False, PREFETCH_TOKENS=0, ELEM_BYTES=2, BALANCED=True, TMA=True),
            types={"kv_desc": f"tensordesc<bf16[1, {block_n}, 128]>"},
            num_warps=warps, num_stages=stages, launch_pdl=True)
           for name, block_n, warps, stages in (("decode_tma", 64, 2, 3),
                                                ("decode_tma_32x4", 32, 2, 4))},
        "rope_trigger": compile_sm90(
            tr.rope_store_kernel, dict(HQ_PAD=32, HKV_PAD=4, HALF=64, TRIGGER=True, FP8=False),
            num_warps=4),
        "rope_fp8": compile_sm90(
            tr.rope_store_kernel, dict(HQ_PAD=32, HKV_PAD=4, HALF=64, TRIGGER=True, FP8=True),
            types=FP8, num_warps=4),
        "decode_fp8": compile_sm90(  # the committed routes' common launch, FP8 KV
            td.decode_split_kernel,
            dict(split, BLOCK_N=64, FUSED=False, MERGE_S=1, PDL=True, EARLY=False,
                 PREFETCH=False, PREFETCH_TOKENS=0, ELEM_BYTES=1, FP8=True),
            types=FP8, num_warps=2, num_stages=3, launch_pdl=True),
        "decode_fp8_fused": compile_sm90(  # the mixed graphs' VARLEN_DECODE, FP8 KV
            td.decode_split_kernel,
            dict(split, BLOCK_N=64, FUSED=True, MERGE_S=4, VARLEN=True, PDL=True,
                 EARLY=False, PREFETCH=False, PREFETCH_TOKENS=0, ELEM_BYTES=1, FP8=True),
            types=FP8, num_warps=4, num_stages=3, launch_pdl=True),
        "decode_fp8_tma": compile_sm90(
            td.decode_split_kernel,
            dict(split, BLOCK_N=64, FUSED=False, MERGE_S=1, PDL=True, EARLY=False,
                 PREFETCH=True, PREFETCH_TOKENS=0, ELEM_BYTES=1, BALANCED=True, TMA=True,
                 FP8=True),
            types={**FP8, "kv_desc": "tensordesc<fp8e4nv[1, 64, 128]>"},
            num_warps=2, num_stages=3, launch_pdl=True),
        **{name: compile_sm90(  # the default launch, and the largest tile the sweep tries
            tsk.skinny_matmul_kernel,
            dict(HAS_BIAS=bias, SPLIT=split, EVEN=True, BLOCK_M=16, BLOCK_N=block_n,
                 BLOCK_K=block_k, DOT_PRECISION="tf32", PDL=pdl, PREFETCH_TILES=2,
                 ELEM_BYTES=2),
            num_warps=warps, num_stages=stages, **({"launch_pdl": True} if pdl else {}))
           for name, block_n, block_k, warps, stages, bias, split, pdl in (
               ("skinny", sk.block_n, sk.block_k, sk.num_warps, sk.num_stages, True, False,
                False),
               ("skinny_split_128x256", 128, 256, 8, 3, False, True, False),
               ("skinny_split_pdl", 64, 128, 4, 4, False, True, True))},
        "silu_trigger": compile_sm90(
            tsi.silu_mul_kernel, dict(BLOCK=256, TRIGGER=True), num_warps=4),
        "decode_reduce_pdl": compile_sm90(
            td.decode_reduce_kernel, dict(SPLITS_PAD=64, BLOCK_D=128,
                                          VARLEN=True, PDL=True, EARLY=True),
            num_warps=4, launch_pdl=True),
        "decode_reduce_sliced": compile_sm90(  # a quarter of the head dim per program
            td.decode_reduce_kernel, dict(SPLITS_PAD=64, BLOCK_D=32,
                                          VARLEN=False, PDL=True, EARLY=False),
            num_warps=4, launch_pdl=True),
        **{name: compile_sm90(
            tp.prefill_kernel,
            dict(GROUP=7, HEAD_DIM=128, BLOCK_M=p.block_m, BLOCK_N=p.block_n, VARLEN=True,
                 SKIP_SINGLE=True, DOT_PRECISION="tf32", REVERSE=p.reverse, FP8=fp8),
            types=FP8 if fp8 else None, num_warps=p.num_warps, num_stages=p.num_stages)
           for name, fp8 in (("prefill", False), ("prefill_fp8", True))},
        "dequant_kv": compile_sm90(  # the dequantising route's kernel, Qwen2.5-7B's layer row
            tdq.dequant_kv_kernel, dict(ROW=1024, ROW_PAD=1024, HEAD_DIM=128, BLOCK_T=16),
            types=FP8, num_warps=4),
        "prefill_fp8_engine": compile_sm90(  # the backend's FP8 config (not warp-specialized)
            tp.prefill_kernel,
            dict(GROUP=7, HEAD_DIM=128, BLOCK_M=fp8c.block_m, BLOCK_N=fp8c.block_n,
                 VARLEN=True, SKIP_SINGLE=True, DOT_PRECISION="tf32", REVERSE=fp8c.reverse,
                 FP8=True),
            types=FP8, num_warps=fp8c.num_warps, num_stages=fp8c.num_stages),
        **{name: compile_sm90(  # Qwen2.5-7B's head dim, a small Llama's without GQA, FP8 KV
            tp.prefill_ws_kernel,
            dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_M=c.block_m, BLOCK_N=c.block_n,
                 SKIP_SINGLE=True, REVERSE=c.reverse, DOT_PRECISION="tf32", FP8=fp8),
            types=FP8 if fp8 else None, num_warps=c.num_warps, num_stages=c.num_stages)
           for name, group, head_dim, c, fp8 in (("prefill_ws", 7, 128, ws, False),
                                                 ("prefill_ws_d64", 1, 64, ws, False),
                                                 ("prefill_ws_fp8", 7, 128, ws8, True))},
    }
    print(json.dumps(out))
""")


def test_default_configs_compile_for_sm90_without_spills() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env,
                         timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    for name in ("decode_fused", "decode_fused_w8", "decode_fused_w4"):
        assert report[name]["atomic"] and report[name]["griddepcontrol"], report[name]
    for name in ("decode_fused", "decode_fused_w8", "decode_fused_w4", "decode_pdl_prefetch"):
        assert report[name]["prefetch"], report[name]
    assert not report["decode_pdl_prefetch"]["atomic"] and not report["decode"]["prefetch"]
    assert report["decode_tma"]["tma"] and report["decode_tma_32x4"]["tma"]
    assert not report["decode"]["tma"]
    assert report["decode_reduce_pdl"]["griddepcontrol"] and report["rope_trigger"]["trigger"]
    assert report["decode_fp8_tma"]["tma"] and report["decode_fp8_tma"]["prefetch"]
    assert report["decode_fp8_fused"]["atomic"] and report["rope_fp8"]["trigger"]
    # early launch: the dependents may launch before this kernel's own wait
    assert report["decode_reduce_pdl"]["trigger_first"]
    assert report["decode_fused_w8"]["trigger_first"]
    assert not report["decode_fused"]["trigger_first"]
    assert not report["decode"]["atomic"] and not report["decode"]["griddepcontrol"]
    assert report["skinny_split_128x256"]["atomic"] and not report["skinny"]["atomic"]
    assert report["skinny"]["wgmma"], "skinny: no Hopper matrix instructions (wgmma)"
    pdl = report["skinny_split_pdl"]
    assert pdl["griddepcontrol"] and pdl["prefetch"] and pdl["cp_async"], pdl
    assert not report["skinny"]["griddepcontrol"] and not report["skinny"]["prefetch"]
    assert report["silu_trigger"]["trigger"]
    for name, r in report.items():
        if name in ("decode_reduce_pdl", "decode_reduce_sliced", "rope_trigger", "rope_fp8",
                    "silu_trigger", "dequant_kv"):
            pass  # no loop: nothing to pipeline
        elif not name.startswith("prefill_ws"):  # its loads are the copy engine's (TMA)
            assert r["cp_async"], f"{name}: loads are not pipelined (no cp.async)"
        stack = int(r["usage"].split("STACK:")[1].split()[0])
        # the FP8 prefill config keeps 80 bytes on the stack and was still the fastest measured
        # (edmm/model/attention_triton.py, PREFILL_FP8); every other kernel keeps none
        assert stack <= (80 if name == "prefill_fp8_engine" else 0), f"{name}: {r['usage']}"
        assert "LOCAL:0 " in r["usage"], f"{name}: {r['usage']}"
        assert r["shared"] <= 227 * 1024, f"{name}: {r['shared']} B of shared memory"
    assert report["prefill"]["wgmma"], "prefill: no Hopper matrix instructions (wgmma)"
    assert report["prefill_fp8"]["wgmma"], "prefill_fp8: no wgmma"
    assert report["prefill_fp8_engine"]["wgmma"], "prefill_fp8_engine: no wgmma"
    for name in ("prefill_ws", "prefill_ws_d64", "prefill_ws_fp8"):
        ws = report[name]
        # Triton drops warp specialization silently when its pass cannot split the loop: then
        # there is no register handover between warpgroups and only num_warps warps.
        assert ws["setmaxnreg"] and ws["warps"] == 12, f"{name} not warp-specialized: {ws}"
        assert ws["wgmma"], f"{name}: no wgmma"
