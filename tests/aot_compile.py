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
bytes of one CTA, and whether the SASS has wgmma (HGMMA) and cp.async (LDGSTS).
"""

import importlib
import json
import os
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


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
                           wgmma="HGMMA" in sass, cp_async="LDGSTS" in sass))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
