"""Models and datasets named by ``tests.profiles.user_models:FACTORY`` in the tests (not a test file)."""

from __future__ import annotations

import os
import signal
import time

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.data import Dataset

PAUSE_DIR = "HYBRIDPIPE_TEST_PAUSE_DIR"     # Fault(phase="pause"): where a test asks a rank to pause


class Gate(nn.Module):
    """Data-dependent control flow: torch.fx cannot trace it."""

    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.linear(x)
        return -self.linear(x)


class Gated(nn.Module):
    def __init__(self, width: int = 8, classes: int = 3):
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.gate = Gate(width)
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.gate(torch.relu(self.inp(x))))


def tiny(hidden: int = 16, classes: int = 5):
    """A user's factory returning (module, example input, loss)."""
    model = nn.Sequential(nn.Linear(12, hidden), nn.Tanh(), nn.Linear(hidden, classes))
    return model, torch.randn(4, 12), nn.functional.cross_entropy


def gated(width: int = 8):
    """A model with an untraceable submodule (Gate) inside a traceable one."""
    return Gated(width), torch.randn(2, width)


def gated_sequential(width: int = 8):
    """An nn.Sequential whose children cannot be traced: profiled child by child."""
    return nn.Sequential(nn.Linear(width, width), Gate(width), Gate(width), nn.Linear(width, 3)), torch.randn(2, width)


class FrozenAndUnused(nn.Module):
    """A frozen first layer (fine-tuning's frozen backbone) and a layer the forward never calls."""

    def __init__(self):
        super().__init__()
        self.frozen = nn.Linear(6, 8).requires_grad_(False)
        self.trained = nn.Linear(8, 3)
        self.spare = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.trained(torch.relu(self.frozen(x)))


def frozen_and_unused():
    return FrozenAndUnused(), torch.randn(4, 6)


def module_only():
    return nn.Linear(3, 3)


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, forward_s: float, backward_s: float):
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x * 1.0

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_s)
        return grad * 1.0, None, None


class Sleepy(nn.Module):
    """Identity whose forward and backward take at least the given seconds (a deliberately slow layer)."""

    def __init__(self, forward_s: float = 0.0, backward_s: float = 0.0):
        super().__init__()
        self.forward_s, self.backward_s = forward_s, backward_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(x, self.forward_s, self.backward_s)


def slow_backward():
    """Linear layers with one Sleepy layer whose backward (not forward) is slow."""
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), Sleepy(0.0, 0.03),
                          nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    return model, torch.randn(4, 8)


def slow_forward():
    model = nn.Sequential(nn.Linear(8, 8), Sleepy(0.03, 0.0), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    return model, torch.randn(4, 8)


class _DieInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    def backward(ctx, grad):
        os.kill(os.getpid(), signal.SIGKILL)
        return grad


class Fault(nn.Module):
    """Identity that SIGKILLs the process whose RANK is ``victim`` on its ``at``-th forward
    (``phase="forward"``) or in that call's backward (``"backward"``), and makes the rank ``slow``
    sleep ``slow_ms`` in every forward or backward (``slow_in``: its peers wait in p2p or all-reduce).
    ``phase="pause"``: the rank R that finds ``pause-R`` in the folder named by the environment's
    ``HYBRIDPIPE_TEST_PAUSE_DIR`` (a test wrote it) in a forward writes ``paused-R`` there and sleeps,
    inside that training step, until it is killed."""

    def __init__(self, victim: int, phase: str, at: int, slow: int, slow_ms: float, slow_in: str):
        super().__init__()
        self.victim, self.phase, self.at, self.calls = victim, phase, at, 0
        self.slow, self.slow_s, self.slow_in = slow, slow_ms / 1000, slow_in

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rank = int(os.environ.get("RANK", "-1"))
        if self.phase == "pause" and (where := os.environ.get(PAUSE_DIR)) and os.path.exists(f"{where}/pause-{rank}"):
            with open(f"{where}/paused-{rank}", "w") as f:
                f.write(str(os.getpid()))
            time.sleep(600)
        if rank == self.victim and self.phase in ("forward", "backward"):
            self.calls += 1
            if self.calls == self.at and self.phase == "forward":
                os.kill(os.getpid(), signal.SIGKILL)
            if self.calls == self.at:
                return _DieInBackward.apply(x)
        slow = self.slow_s if rank == self.slow else 0.0       # a custom Function either way: captured by
        return _Sleep.apply(x, slow if self.slow_in == "forward" else 0.0,    # torch.fx, this code runs as written
                            slow if self.slow_in == "backward" else 0.0)


_OPTIMIZER_HOOKS: list = []


def faulty(victim: int = -1, phase: str = "forward", at: int = 20, slow: int = -1, slow_ms: float = 0.0,
           slow_in: str = "forward"):
    """Three blocks [Linear, Fault, ReLU] and a head (nodes 0-2, 3-5, 6-9 with ``[leaf=Fault]``);
    ``phase="optimizer"``: rank ``victim`` SIGKILLs itself before its ``at``-th optimizer step."""
    if phase == "optimizer" and not _OPTIMIZER_HOOKS:
        steps = [0]

        def hook(optimizer, args, kwargs) -> None:
            if int(os.environ.get("RANK", "-1")) == victim:
                steps[0] += 1
                if steps[0] == at:
                    os.kill(os.getpid(), signal.SIGKILL)
        _OPTIMIZER_HOOKS.append(register_optimizer_step_pre_hook(hook))
    blocks: list[nn.Module] = []
    for _ in range(3):
        blocks += [nn.Linear(16, 16), Fault(victim, phase, at, slow, slow_ms, slow_in), nn.ReLU()]
    return nn.Sequential(*blocks, nn.Linear(16, 4)), torch.randn(4, 16)


class Pairs(Dataset):
    """A user's map-style dataset of (input, target) pairs."""

    def __init__(self, n: int = 10, features: int = 12):
        self.x = torch.randn(n, features, generator=torch.Generator().manual_seed(1))
        self.y = torch.arange(n) % 5

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def pairs(n: int = 10, features: int = 12) -> Pairs:
    return Pairs(n, features)


def not_a_dataset():
    return 42


# ---- a user's code that goes wrong (tests/test_bad_inputs.py) ------------------------------------
def raising(width: int = 4):
    """A model factory that raises (the line below is named in the error)."""
    raise RuntimeError(f"cannot build a model of width {width}")


def misfit():
    """A model whose example input does not fit its first layer."""
    return nn.Sequential(nn.Linear(8, 3)), torch.randn(2, 5)


def raising_dataset():
    raise ValueError("the data directory is empty")


class NaNAfter(Dataset):
    """Samples of the zoo ``mlp``'s shape (64 features, 10 classes) whose inputs are NaN for
    indices in ``[start, stop)`` (a corrupt stretch of a data set)."""

    def __init__(self, n: int, start: int, stop: int):
        g = torch.Generator().manual_seed(5)
        self.x = torch.randn(n, 64, generator=g)
        self.x[start:stop] = float("nan")
        self.y = torch.randint(0, 10, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def nan_after(n: int = 64, start: int = 16, stop: int = 24) -> NaNAfter:
    return NaNAfter(n, start, stop)


# ---- transformers: nn.TransformerEncoder, a Hugging Face GPT-2 fed padded batches ---------------

def token_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of every position's vector (as class scores) against a class id per position."""
    return nn.functional.cross_entropy(output.flatten(0, 1), target.flatten())


def transformer_encoder(layers: int = 4, width: int = 32, heads: int = 2, seq: int = 16, batch: int = 2):
    """torch's own nn.TransformerEncoder (its layers are an nn.ModuleList: one block each), token loss."""
    layer = nn.TransformerEncoderLayer(width, heads, dim_feedforward=2 * width, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
    return model, torch.randn(batch, seq, width), token_loss


def gpt2_padded(layers: int = 2, width: int = 32, heads: int = 2, vocab: int = 128, seq: int = 16, batch: int = 2):
    """A Hugging Face GPT2LMHeadModel (head tied to the input embedding, no dropout) taking
    ``input_ids``, ``attention_mask`` and ``labels`` (-100: padding), as ``ragged_tokens`` gives them."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=layers, n_embd=width, n_head=heads, vocab_size=vocab, n_positions=128,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    ids = torch.randint(1, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    return GPT2LMHeadModel(config), {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


class RaggedTokens(Dataset):
    """Token sequences of ``low``..``high`` tokens; ``collate_fn`` pads a batch to its longest one
    (input ids 0, attention mask 0, labels -100), so batches differ in length from step to step."""

    def __init__(self, n: int = 64, vocab: int = 128, low: int = 16, high: int = 64, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(low, high + 1, (n,), generator=g)
        self.items = [torch.randint(1, vocab, (int(length),), generator=g) for length in lengths]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.items[i]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}

    @staticmethod
    def collate_fn(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        def pad(key: str, value: int) -> torch.Tensor:
            return nn.utils.rnn.pad_sequence([s[key] for s in samples], batch_first=True, padding_value=value)

        return {"input_ids": pad("input_ids", 0), "attention_mask": pad("attention_mask", 0),
                "labels": pad("labels", -100)}


def ragged_tokens(n: int = 64, vocab: int = 128, low: int = 16, high: int = 64, seed: int = 0) -> RaggedTokens:
    return RaggedTokens(n, vocab, low, high, seed)


class WithSpare(nn.Module):
    """An MLP holding a layer its forward never calls (as BartForCausalLM holds cross-attention) and a
    saved buffer it never reads."""

    def __init__(self, width: int = 16, classes: int = 5):
        super().__init__()
        self.inp = nn.Linear(12, width)
        self.mid = nn.Linear(width, width)
        self.spare = nn.Linear(width, width)
        self.head = nn.Linear(width, classes)
        self.register_buffer("calls", torch.arange(3.0))        # saved, never read by forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(torch.tanh(self.inp(x)))))


def with_spare(width: int = 16):
    """WithSpare: (module, example input); cross-entropy over 5 classes."""
    return WithSpare(width), torch.randn(4, 12)
