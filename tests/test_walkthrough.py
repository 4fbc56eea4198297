"""The walkthrough (tutorial/walkthrough/): every step trains exactly as native DDP, the recipe
says so (and fails when a step drifts), and docs/walkthrough.md is the rendering of its data."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
import torch

from train_cases import ROOT


def step_against_native(name: str) -> float:
    """Rank function: 3 AdamW steps of a small GPT with walkthrough step `name` and with native DDP,
    from different weights on each rank; the largest parameter difference."""
    from torch.nn.parallel import DistributedDataParallel

    from minidist.train.models import GPT
    from tutorial.walkthrough import STEPS, Zero1DataParallel

    rank = torch.distributed.get_rank()
    finals = []
    for which in ("native", name):
        torch.manual_seed(rank)
        net = GPT(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
        adamw = lambda ps: torch.optim.AdamW(ps, lr=1e-2)  # noqa: E731
        if which == "native":
            model, opt = DistributedDataParallel(net, bucket_cap_mb=0.01), adamw(net.parameters())
        elif STEPS[which] is Zero1DataParallel:
            model, opt = STEPS[which](net, adamw), None
        else:
            model = STEPS[which](net) if which == "1 naive" else STEPS[which](net, bucket_cap_mb=0.01)
            opt = adamw(net.parameters())
        for step in range(3):
            g = torch.Generator().manual_seed(10 * step + rank)
            x = torch.randint(0, 64, (4, 16), generator=g)
            GPT.loss(model(x), torch.roll(x, -1, 1)).backward()
            if which != "native":
                model.finish_gradients()
            if opt is None:
                model.step()
            else:
                opt.step()
                opt.zero_grad(set_to_none=True)
        finals.append([p.detach().clone() for p in net.parameters()])
    return max((a - b).abs().max().item() for a, b in zip(*finals))


@pytest.mark.parametrize("name", ["1 naive", "2 buckets", "3 overlap", "4 zero1"])
def test_every_step_is_bitwise_native_ddp(ranks, name):
    assert ranks(2).run(step_against_native, name) == [0.0, 0.0]


@pytest.mark.slow(stand_in="test_every_step_is_bitwise_native_ddp")  # 15 s; and the drift check below
def test_the_recipe_runs_every_step_and_draws_its_timeline(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "recipes" / "walkthrough.py"), "warmup=0", "steps=1",
                           "gpt.n_layer=2", f"hydra.run.dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert list(results["rows"]) == ["native DDP", "1 naive", "2 buckets", "3 overlap", "4 zero1"]
    assert all(r["max_diff"] == 0.0 for r in results["rows"].values())
    assert all((tmp_path / f"timeline_{n.replace(' ', '_')}.png").is_file() for n in results["rows"])


def load_recipe():
    spec = importlib.util.spec_from_file_location("walkthrough_recipe", ROOT / "recipes" / "walkthrough.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_step_that_drifts_is_named(tmp_path):
    rows = {"native DDP": {"max_diff": 0.0}, "1 naive": {"max_diff": 0.0}, "3 overlap": {"max_diff": 2e-3}}
    (tmp_path / "results.json").write_text(json.dumps({"tolerance": 1e-6, "rows": rows}))
    assert load_recipe().drifted(tmp_path) == ["3 overlap"]


def test_the_document_is_the_rendering_of_its_data():
    spec = importlib.util.spec_from_file_location("make_walkthrough_doc", ROOT / "scripts" / "make_walkthrough_doc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.render() == (ROOT / "docs" / "walkthrough.md").read_text(), \
        "docs/walkthrough.md differs from its data: run python scripts/make_walkthrough_doc.py --render-only"
    provenance = json.loads(module.DATA.read_text())["provenance"]
    assert provenance["command"] == "python recipes/walkthrough.py" and len(provenance["commit"]) >= 40
