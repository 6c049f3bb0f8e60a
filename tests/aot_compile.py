"""Ahead-of-time compile of an evenkv Triton kernel for a CUDA target, on any machine.

Triton ships ptxas and cuobjdump, so a kernel compiles for sm_80 / sm_90a without a GPU.
Run in a fresh interpreter without TRITON_INTERPRET (under it @triton.jit gives interpreter
objects that cannot be compiled); tests call it through ``helpers.aot_compile``.

    python tests/aot_compile.py SPEC_JSON

SPEC: {"kernel": "module:name", "bf16": [pointer args of bf16 data], "fp32_ptrs": [fp32
pointer args], "fp32": [fp32 scalar args], "unaligned": [int args not divisible by 16],
"variants": [{"cap": 90, "consts": {...}, "options": {"num_warps": 4, ...}}]}. Every other
``*_ptr`` argument is an int32 pointer, every other upper-case one a constexpr, the rest
int32; pointers and strides are 16-byte aligned as the JIT sees them for real inputs.
Prints one JSON list, per variant: registers and stack bytes per thread, shared memory
bytes of one CTA, whether the SASS has wgmma (HGMMA) and cp.async (LDGSTS), and
``mma_loop_spills``: local-memory loads and stores (LDL / STL) inside an innermost loop
whose body has an MMA, i.e. spills that cost on every tile (a spill outside the tile loop
costs once per segment or once per CTA).
"""

import importlib
import json
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


def mma_loop_spills(sass: str) -> int:
    """LDL/STL instructions inside an innermost loop whose body has an HMMA or HGMMA (the
    tile loop, not an outer loop around it). A loop is the address range [target, branch]
    of a backward branch (``BRA`` to a lower address)."""
    code = [(int(addr, 16), text) for addr, text in SASS_LINE.findall(sass)]
    loops = []
    for addr, text in code:
        jump = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
        if jump and int(jump.group(1), 16) < addr:
            loops.append((int(jump.group(1), 16), addr))
    mma_loops = [(lo, hi) for lo, hi in loops
                 if any(lo <= a <= hi and re.search(r"\bH(G)?MMA\b", t) for a, t in code)]
    innermost = [(lo, hi) for lo, hi in mma_loops
                 if not any((lo, hi) != (l2, h2) and lo <= l2 and h2 <= hi for l2, h2 in mma_loops)]
    return sum(1 for a, t in code if re.search(r"\b(LDL|STL)\b", t) and any(lo <= a <= hi for lo, hi in innermost))


def main():
    spec = json.loads(sys.argv[1])
    module, name = spec["kernel"].split(":")
    kernel = getattr(importlib.import_module(module), name)
    names = kernel.arg_names
    sig = {}
    for n in names:
        if n.endswith("_ptr"):
            sig[n] = "*bf16" if n in spec.get("bf16", ()) else "*fp32" if n in spec.get("fp32_ptrs", ()) else "*i32"
        else:
            sig[n] = "fp32" if n in spec.get("fp32", ()) else "constexpr" if n.isupper() else "i32"
    aligned = [n for n in names if n.endswith("_ptr") or (n.startswith("stride") and n not in spec.get("unaligned", ()))]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    result = []
    for v in spec["variants"]:
        compiled = triton.compile(ASTSource(kernel, sig, v["consts"], attrs), target=GPUTarget("cuda", v["cap"], 32),
                                  options=v["options"])
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(compiled.asm["cubin"])
            f.flush()
            usage = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True,
                                   check=True).stdout
            sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout
        field = lambda key: int(usage.split(key + ":")[1].split()[0])  # noqa: E731
        result.append(dict(regs=field("REG"), stack=field("STACK"), shared=compiled.metadata.shared,
                           wgmma="HGMMA" in sass, cp_async="LDGSTS" in sass, mma_loop_spills=mma_loop_spills(sass)))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
