"""Why does flex's FLASH backend (FA4 inside flex) fail on our block masks? A GPU diagnostic.

Compiles ``flex_attention`` with ``kernel_options={"BACKEND": "FLASH"}`` on one small problem with
mask_mods of growing complexity, from a plain causal one to the bitmap lookup the flex backend uses
(backends/block_bitmap.py), and writes for each whether it compiled, its error and the traceback tail.

    source .devdeps/unpack.sh && PYTHONPATH=. python benchmarks/flex_flash_probe.py --out $OUT/flex_flash
"""

from __future__ import annotations

import argparse
import json
import traceback
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from inductor_attn.backends import flex
from inductor_attn.backends.block_bitmap import bitmap_lookup, slot_table
from inductor_attn.block_mask import BlockSparseMask

L, D, H = 1024, 128, 4


def causal(b, h, q, kv):
    return q >= kv


def mask_mods():
    dev = "cuda"
    doc = (torch.arange(L, device=dev) // 300).int()
    table = torch.ones(L // 128, L // 128, dtype=torch.bool, device=dev).tril()
    words = torch.full((L, L // 32), -1, dtype=torch.int32, device=dev)

    def doc_lookup(b, h, q, kv):  # one captured 1-D tensor, indexed by q and kv
        return doc[q] == doc[kv]

    def table_lookup(b, h, q, kv):  # a captured 2-D tensor indexed by block numbers
        return table[q // 128, kv // 128] & (q >= kv)

    def word_bits(b, h, q, kv):  # bit extraction from int32 words, as the bitmap lookup does
        return ((words[q, kv // 32] >> (kv % 32)) & 1) == 1

    sparse = BlockSparseMask.from_block_mask(create_block_mask(causal, None, None, L, L, device=dev))
    slots, bits = slot_table(sparse), sparse.partial_bits

    def bitmap(b, h, q, kv):  # what backends/flex.py runs
        return bitmap_lookup(slots, bits, sparse.block_q, sparse.block_kv, b, h, q, kv)

    return {"causal": causal, "doc_lookup": doc_lookup, "table_lookup": table_lookup,
            "word_bits": word_bits, "bitmap_lookup": bitmap}, sparse


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch._dynamo.config.recompile_limit = 64
    q, k, v = (torch.randn(1, H, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    compiled = torch.compile(flex_attention, fullgraph=True, dynamic=False)
    mods, sparse = mask_mods()
    results = {}
    for name, mod in mods.items():
        bm = create_block_mask(mod, None, None, L, L, device="cuda")
        try:
            out = compiled(q, k, v, block_mask=bm, kernel_options={"BACKEND": "FLASH"})
            ref = flex_attention(q, k, v, block_mask=bm)
            results[name] = {"ok": True, "max_abs_err": float((out - ref).abs().max())}
        except Exception as e:  # noqa: BLE001 - a diagnostic: keep every failure's text
            results[name] = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:3000]}",
                             "traceback_tail": traceback.format_exc()[-4000:]}
        print(name, "ok" if results[name]["ok"] else results[name]["error"][:400], flush=True)
    # the exact BlockMask the flex backend builds (from_kv_blocks + bitmap mask_mod)
    try:
        out = compiled(q, k, v, block_mask=flex.to_flex_block_mask(sparse), kernel_options={"BACKEND": "FLASH"})
        results["backend_block_mask"] = {"ok": True}
    except Exception as e:  # noqa: BLE001
        results["backend_block_mask"] = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:3000]}",
                                         "traceback_tail": traceback.format_exc()[-4000:]}
    print("backend_block_mask", results["backend_block_mask"].get("error", "ok")[:400], flush=True)
    (args.out / "flex_flash_probe.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
