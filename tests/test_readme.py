"""The README's quick start runs as written (its CPU variant, under the interpreter)."""

import re
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parent.parent / "README.md"


@pytest.mark.interpreter
def test_readme_quick_start_runs_on_cpu():
    """The python block of "Use the kernels directly", with "cuda" replaced by "cpu" as the
    README says, gives the reference result."""
    from evenkv.kernels.reference import decode_reference
    from evenkv.testing import max_error, tolerance

    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) == 1, "expected one python block in the README"
    scope = {}
    exec(blocks[0].replace('"cuda"', '"cpu"'), scope)  # noqa: S102 - the README's own code
    out, q, k, v = scope["out"], scope["q"], scope["k_cache"], scope["v_cache"]
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    rows = [0, 1, q.shape[0] - 1]
    ref = decode_reference(q[rows], k, v, scope["seq_lens"][rows], scope["page_table"][rows], 16)
    assert max_error(out[rows], ref) <= tolerance(ref, ref.to(torch.bfloat16), torch.bfloat16)
