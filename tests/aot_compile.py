"""Ahead-of-time compile of an evenkv Triton kernel for a CUDA target, on any machine.

Triton ships ptxas and cuobjdump, so a kernel compiles for sm_80 / sm_90a without a GPU.
Run in a fresh interpreter without TRITON_INTERPRET (under it @triton.jit gives interpreter
objects that cannot be compiled); tests call it through ``helpers.aot_compile``.

    python tests/aot_compile.py SPEC_JSON

SPEC: {"kernel": "module:name", "bf16": [pointer args of bf16 data], "fp8": [pointer args of
e4m3 data], "fp32_ptrs": [fp32 pointer args], "i64_ptrs": [int64 pointer args], "fp32": [fp32 scalar args],
"unaligned": [int args not divisible by 16],
"variants": [{"cap": 90, "consts": {...}, "options": {"num_warps": 4, ...}}]}. Every other
``*_ptr`` argument is an int32 pointer, every other upper-case one a constexpr, the rest
int32; pointers and strides are 16-byte aligned as the JIT sees them for real inputs.
Prints one JSON list, per variant: registers and stack bytes per thread, shared memory
bytes of one CTA, whether the SASS has wgmma (HGMMA, or QGMMA on 8-bit operands) and cp.async
(LDGSTS), whether ptxas serialized the wgmmas (``wgmma_serialized``: its note C7515, given when
it cannot prove an accumulator untouched while its wgmma is in flight), the instructions of
one trip of the tile loop (``mma_loop_instructions``, and by opcode ``mma_loop_ops``), and the
local-memory traffic of the innermost loop whose body has an MMA (the tile loop; a spill
outside it costs once per segment or once per CTA): ``mma_loop_spills``, the spill stores
(STL) in it and the loads (LDL) of local slots it stores, i.e. loop state that goes
through local memory on every tile; ``mma_loop_reloads``, its loads of slots stored only
outside it, i.e. a loop-invariant value rematerialised from local memory (an L1 hit); and
``stack_pointer_data_reads``, the conversion and arithmetic instructions that read the stack
pointer as data (a ptxas miscompile; any is a wrong result).
"""

import collections
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


LOCAL_ACCESS = re.compile(r"\b(LDL|STL)\b[^\[]*\[([^\]]+)\]")


# ptxas's note that it waits for every wgmma before issuing the next one, in the whole kernel.
WGMMA_SERIALIZED = "wgmma.mma_async instructions are serialized"


MMA = re.compile(r"\b[HQI]G?MMA\b")  # HMMA (mma.sync), HGMMA / QGMMA (16-bit / 8-bit wgmma), IMMA


# R1 is the stack pointer in ptxas's code (``LDC R1, c[0x0][0x28]`` at entry): as an address base
# ([R1+...]) it reaches local memory; as a data operand of a conversion or arithmetic instruction
# it is a miscompile. Seen with Triton 3.6's ptxas (12.8.93): e4m3 values packed from fp32 and
# unpacked again in the same thread, with some unpacks (``F2FP.F16.E4M3.UNPACK_B``) reading R1
# in place of the packed pair.
DATA_OP = re.compile(r"^(?:@!?U?P\w+\s+)?(?:F2FP|F2F|I2F|F2I|HADD2|HMUL2|HFMA2|FADD|FMUL|FFMA|FMNMX|PRMT)\b\S*\s+[^,]+,(.*)$")
STACK_POINTER = re.compile(r"(?<![\w\[+.])[-|]?R1(?![0-9])")


def stack_pointer_data_reads(sass: str) -> list[str]:
    """The conversion and arithmetic instructions of ``sass`` that read R1, the stack pointer,
    as a source operand (outside an address)."""
    return [text for _, text in SASS_LINE.findall(sass)
            for m in [DATA_OP.match(text)] if m and STACK_POINTER.search(re.sub(r"\[[^\]]*\]", "", m.group(1)))]


def innermost_mma_loops(code: list[tuple[int, str]]) -> list[tuple[int, int]]:
    """The innermost loops of SASS ``code`` [(address, instruction)] whose body has an MMA (the
    tile loop, not an outer loop around it), as address ranges [target, branch] of backward
    branches (``BRA`` to a lower address)."""
    loops = []
    for addr, text in code:
        jump = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
        if jump and int(jump.group(1), 16) < addr:
            loops.append((int(jump.group(1), 16), addr))
    mma_loops = [(lo, hi) for lo, hi in loops if any(lo <= a <= hi and MMA.search(t) for a, t in code)]
    return [(lo, hi) for lo, hi in mma_loops
            if not any((lo, hi) != (l2, h2) and lo <= l2 and h2 <= hi for l2, h2 in mma_loops)]


def mma_loop_local_traffic(sass: str) -> tuple[int, int]:
    """(spills, reloads) inside the innermost MMA loops: spills = STL there plus LDL there of a
    local slot also stored there; reloads = LDL there of a slot stored only outside."""
    code = [(int(addr, 16), text) for addr, text in SASS_LINE.findall(sass)]
    innermost = innermost_mma_loops(code)
    inside = [(m.group(1), m.group(2).replace(" ", "")) for a, t in code
              if any(lo <= a <= hi for lo, hi in innermost) for m in [LOCAL_ACCESS.search(t)] if m]
    stored_inside = {slot for op, slot in inside if op == "STL"}
    spills = sum(1 for op, slot in inside if op == "STL" or slot in stored_inside)
    return spills, len(inside) - spills


def mma_loop_ops(sass: str) -> dict[str, int]:
    """Instructions of the innermost MMA loops by opcode (predicates and modifiers dropped),
    most frequent first: what one trip of the tile loop issues."""
    code = [(int(addr, 16), text) for addr, text in SASS_LINE.findall(sass)]
    innermost = innermost_mma_loops(code)
    ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for a, t in code
                              if any(lo <= a <= hi for lo, hi in innermost))
    return dict(ops.most_common())


def main():
    spec = json.loads(sys.argv[1])
    module, name = spec["kernel"].split(":")
    kernel = getattr(importlib.import_module(module), name)
    names = kernel.arg_names
    sig = {}
    for n in names:
        if n.endswith("_ptr"):
            sig[n] = ("*bf16" if n in spec.get("bf16", ()) else "*fp8e4nv" if n in spec.get("fp8", ()) else
                      "*fp32" if n in spec.get("fp32_ptrs", ()) else "*i64" if n in spec.get("i64_ptrs", ()) else
                      "*i32")
        else:
            sig[n] = "fp32" if n in spec.get("fp32", ()) else "constexpr" if n.isupper() else "i32"
    aligned = [n for n in names if n.endswith("_ptr") or (n.startswith("stride") and n not in spec.get("unaligned", ()))]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    cuobjdump, ptxas = os.path.join(tools, "cuobjdump"), os.path.join(tools, "ptxas")
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
        with tempfile.NamedTemporaryFile(suffix=".ptx", mode="w") as ptx:
            ptx.write(compiled.asm["ptx"])
            ptx.flush()
            ptxas_log = subprocess.run([ptxas, f"-arch=sm_{v['cap']}{'a' if v['cap'] == 90 else ''}", "-v", ptx.name,
                                        "-o", os.devnull], capture_output=True, text=True, check=True).stderr
        field = lambda key: int(usage.split(key + ":")[1].split()[0])  # noqa: E731
        spills, reloads = mma_loop_local_traffic(sass)
        ops = mma_loop_ops(sass)
        result.append(dict(regs=field("REG"), stack=field("STACK"), shared=compiled.metadata.shared,
                           wgmma=bool(re.search(r"\b[HQ]GMMA\b", sass)), cp_async="LDGSTS" in sass,
                           wgmma_serialized=WGMMA_SERIALIZED in ptxas_log,
                           mma_loop_spills=spills, mma_loop_reloads=reloads,
                           mma_loop_instructions=sum(ops.values()), mma_loop_ops=ops,
                           stack_pointer_data_reads=stack_pointer_data_reads(sass)))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
