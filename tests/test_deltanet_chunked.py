"""A gated DeltaNet prompt runs the delta rule in chunks (models/deltanet.py, `chunked`), a
decode step token by token (`by_token`): the two give the same outputs and leave the same state,
so decode carries on from a chunked prompt as from one fed a token at a time, whether the prompt
starts from zeros or from a state already there (a prompt's second step, a conversation's next
turn), and whatever its length against the chunk's.

"The same": the largest difference, output or state, is at most 1e-4 of the largest magnitude
of the token-by-token one (float32; the two differ only in the order of their sums).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_qwen35 import SMALL

from edgetp.models import deltanet
from edgetp.models.config_files import config_from_hf
from edgetp.models.layers import Slice

RELATIVE = 1e-4
NV, DK, DV = 4, 16, 24


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    worst = float((got - want).abs().max())
    bound = RELATIVE * float(want.abs().max())
    assert worst <= bound, f"{what}: {worst:.2e} > {bound:.2e}"


def _rule_inputs(T: int, seed: int) -> tuple[torch.Tensor, ...]:
    """q, k, v, beta, g as the layer makes them: unit keys and queries (q / sqrt(dk)), beta in
    (0, 1), and log decays from about -0.002 to -400 (a head that forgets all in one token)."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(T, NV, DK, generator=gen), dim=-1) * DK**-0.5
    k = F.normalize(torch.randn(T, NV, DK, generator=gen), dim=-1)
    v = torch.randn(T, NV, DV, generator=gen)
    beta = torch.rand(T, NV, generator=gen)
    g = -torch.exp(2 * torch.randn(T, NV, generator=gen))
    return q, k, v, beta, g


@pytest.mark.parametrize("from_state", [False, True], ids=["from zeros", "from a state"])
@pytest.mark.parametrize("T", [1, 2, 63, 64, 65, 200])
def test_chunked_equals_token_by_token(T, from_state):
    q, k, v, beta, g = _rule_inputs(T, seed=T)
    start = torch.randn(NV, DK, DV) if from_state else torch.zeros(NV, DK, DV)
    by_token, chunked = start.clone(), start.clone()
    want = deltanet.by_token(q, k, v, beta, g, by_token)
    got = deltanet.chunked(q, k, v, beta, g, chunked)
    assert got.shape == want.shape == (T, NV, DV)
    _close(got, want, f"{T} tokens' outputs")
    _close(chunked, by_token, f"the state after {T} tokens")


def test_a_prompt_in_two_steps_then_decode_carries_on_as_token_by_token():
    """`recur`, convolution and all, on one slice's heads (2 value heads of 1 key head): a
    130-token prompt in one step, or in steps of 70 and 60 (the second from the first's
    state), then 3 decode steps, gives what 133 steps of one token give."""
    config = config_from_hf(
        {
            **SMALL,
            "architectures": ["Qwen3_5ForCausalLM"],
            "model_type": "qwen3_5_text",
            "intermediate_size": 128,
            "vocab_size": 320,
            "linear_conv_kernel_dim": 4,
        },
        "a small Qwen3.5",
    )
    s = Slice((0, 0), (0, 0), (0, 0), linear_heads=(2, 4), linear_key_heads=(1, 2))
    C = sum(deltanet.channels(config, s))
    K = config.linear_conv
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(133, C, generator=gen)
    beta = torch.rand(133, s.n_linear, generator=gen)
    g = -torch.exp(torch.randn(133, s.n_linear, generator=gen))
    taps = torch.randn(C, K, generator=gen)

    def fed(steps: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        conv, state = torch.zeros(C, K - 1), torch.zeros(s.n_linear, 16, 16)
        outs, at = [], 0
        for n in steps:
            step = slice(at, at + n)
            outs.append(deltanet.recur(x[step], beta[step], g[step], taps, conv, state, s, config))
            at += n
        return torch.cat(outs), conv, state

    want, want_conv, want_state = fed([1] * 133)
    for steps in ([130, 1, 1, 1], [70, 60, 1, 1, 1]):
        out, conv, state = fed(steps)
        _close(out, want, f"outputs fed as {steps}")
        _close(state, want_state, f"the state fed as {steps}")
        assert torch.equal(conv, want_conv), steps  # the convolution's inputs, kept as they are
