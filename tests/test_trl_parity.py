"""Our SDPO against the reference implementation, TRL's SDPOTrainer, on one batch, without TRL:
TRL's side (its teacher-context builder, per-token divergence, and loss and gradient over
micro-batches) was recorded once on the tests' tiny model into tests/trl_sdpo_parity.json
(`python bench/trl_parity.py --record`, the TRL release it names). Ours must build the same
teacher input ids, the same per-token divergence, and, with --sdpo.loss_agg=seq_mean_token_mean
(TRL's aggregation), the same loss and gradient. If the tests' tiny model or tokenizer changes,
every test here fails: record again with that release installed (bench-only)."""
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import trl_parity  # noqa: E402  (bench/ is not a package)
from golden import fingerprint  # noqa: E402

with open(trl_parity.FIXTURE) as f:
    RECORDED = json.load(f)
AGAIN = (f"; if the tests' tiny model or tokenizer changed, record TRL's side again: "
         f"pip install trl=={RECORDED['trl_version']} && {RECORDED['command']}")


@pytest.fixture(scope="module")
def ours(tmp_path_factory, tokenizer):
    """Our side of the recorded batch, on the same (sharpened) tiny model."""
    assert len(tokenizer) == RECORDED["vocab"], "the tiny tokenizer's vocabulary changed" + AGAIN
    model = trl_parity.sharpened_tiny(str(tmp_path_factory.mktemp("sharpened")))
    flags = trl_parity.our_flags(model, "strops", RECORDED["temperature"]) + RECORDED["flags"] + [
        f"--train.micro_batch={RECORDED['micro_batch']}"]
    batch = {key: RECORDED[key] for key in ("rows", "samples", "n")}
    return trl_parity.ours(model, tokenizer, batch, flags)


def test_the_teacher_sees_what_trls_teacher_sees(ours, tokenizer):
    """Token for token: the student's prompt, and the teacher's (the demonstration of the group's
    first other success, the template around it, the student's own response ids after it); and
    the same samples distilled (a group without a success: none; a success: another's)."""
    differences = (trl_parity.id_differences(tokenizer, "student prompt ids", RECORDED["prompt_ids"], ours["prompt_ids"])
                   + trl_parity.id_differences(tokenizer, "teacher input ids", RECORDED["teacher_ids"],
                                               ours["teacher_ids"]))
    assert not differences, "\n".join(differences) + AGAIN
    assert ours["mask"] == RECORDED["mask"] and 0 < sum(ours["mask"]) < len(ours["mask"])


def test_the_per_token_divergence_is_trls(ours):
    """Top-8 with a tail, JSD alpha 0.5, at the sampling temperature, on every distilled token."""
    used = [i for i, m in enumerate(RECORDED["mask"]) if m > 0]
    for i in used:
        theirs, mine = RECORDED["divergence"][i], ours["divergence"][i]
        assert len(mine) == len(theirs)
        assert max(abs(a - b) for a, b in zip(theirs, mine)) <= 1e-5, f"sample {i}" + AGAIN
    assert sum(sum(RECORDED["divergence"][i]) for i in used) > 0.01  # far above the rounding it is checked to


def test_the_references_aggregation_gives_trls_loss_and_gradient(ours):
    """TRL's loss over micro-batches of 4 (its accumulation scale) is the mean over all 12 samples of
    each one's token mean; ours with --sdpo.loss_agg=seq_mean_token_mean the same, to float
    rounding, and its gradient to 1e-3 of each tensor's norm (each tensor's sum, sum of squares and random projection,
    tests/golden.py's fingerprint); the default token_mean is measurably another loss."""
    grads, loss = ours["seq_mean_token_mean"]
    assert loss == pytest.approx(RECORDED["loss"], rel=1e-4), AGAIN
    got = fingerprint(grads)
    assert got.keys() == RECORDED["grads"].keys()
    for tensor, (total, squares, projection) in RECORDED["grads"].items():
        # sums and projections cancel: their rounding is relative to the norm; TRL runs padded rows
        # through HF's forward, we packed ones, and the sharpened logits amplify the difference
        # (measured: up to 3e-4 of the norm; token_mean moves them by up to 3x the norm)
        norm = squares ** 0.5
        assert got[tensor][1] == pytest.approx(squares, rel=1e-3, abs=1e-16), tensor
        assert got[tensor][0] == pytest.approx(total, abs=1e-3 * norm + 1e-12), tensor
        assert got[tensor][2] == pytest.approx(projection, abs=1e-3 * norm + 1e-12), tensor
    token_loss = ours["token_mean"][1]
    assert abs(token_loss - RECORDED["loss"]) > 0.1 * RECORDED["loss"]
