import torch
from torch import nn

import gradlog


def test_demo_names_exactly_the_planted_bugs() -> None:
    from gradlog.cli.demo import run

    report = run(steps=30, every=5, writer="memory")
    found = {(r.name, r.reason) for r in report.never_updated}
    assert found == {
        ("late.weight", gradlog.Reason.NOT_IN_OPTIMIZER),
        ("aux_head.weight", gradlog.Reason.NO_GRAD),
    }
    # the layer whose lr the scheduler cuts to 0 at step 15 (half of 30): last measured update at 10
    # and the layer frozen by mistake at step 10 (a third of 30): last measured update at 5
    stalled = {(r.name, r.since_step, r.last_update_step, r.reason) for r in report.stalled}
    assert stalled == {
        ("frozen.weight", 10, 5, gradlog.Reason.FROZEN),
        ("fade.weight", 15, 10, gradlog.Reason.ZERO_LR),
        ("fade.bias", 15, 10, gradlog.Reason.ZERO_LR),
    }
    # the embedding's rows 16..31 are never looked up (the per-slice diagnosis names them)
    from gradlog.cli.demo import TOKENS, token_ids

    seen = token_ids(torch.randn(10_000, 16, generator=torch.Generator().manual_seed(0))).unique().tolist()
    assert seen == list(range(16)) and TOKENS == 32
    assert not report.healthy


def test_grad_norm_matches_vector_norm() -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mem = gradlog.MemoryWriter()
    gl = gradlog.GradLogger(model, opt, writer=mem, every=1, print_report=False)
    model(torch.randn(4, 3)).pow(2).sum().backward()
    expected = torch.linalg.vector_norm(model.weight.grad).item()
    opt.step()
    gl.log(0)
    gl.close()
    assert abs(mem.last("weights/grad_norm/weight") - expected) < 1e-6 * max(expected, 1)
