"""The input shapes a captured graph is valid for (profiles/input_shapes.py): where a model's code
computes from a size, torch.export fixes or bounds that dimension, and a batch outside it would run
through the graph computing something else than the model. Before the capture kept export's checks
(it dropped ``ExportedProgram.module()``'s ``_guards_fn`` call), such batches trained silently:
MobileNetV2 captured on 32x32 images and fed 33x33 ones ended 2877 apart from one process after 2
steps (its TensorFlow "same" padding computed for 32); an image-size branch like the one below ran
its even-size padding on odd sizes. Now every batch is checked where it enters the graph
(``CapturedModel.flatten_input``) and refused in one line; batches within the bounds run as before."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hybridpipe.errors import UserError
from hybridpipe.profiles.capture import capture_model
from hybridpipe.profiles.capture_cache import dump_capture, load_capture
from hybridpipe.profiles.input_shapes import InputShapes


class SamePad(nn.Module):
    """A stride-2 convolution with TensorFlow's "same" padding, computed from the input's width
    (as MobileNetV2's and EfficientNet's ``tf_padding``): even and odd widths pad differently."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        width = x.shape[-1]
        pad = 1 if width % 2 == 0 else 2
        return self.conv(F.pad(x, (pad // 2, pad - pad // 2, pad // 2, pad - pad // 2))).mean()


class Positions(nn.Module):
    """A learned position table of 6 rows: sequences up to 6 tokens (export bounds the length)."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(6, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.unsqueeze(-1) * self.table[: x.shape[1]]).mean()


def run_graph(captured, x: torch.Tensor) -> torch.Tensor:
    values = captured.flatten_input(x)
    return captured.graph(*values.values())[0]


def test_a_batch_the_graph_was_not_captured_for_is_refused_in_one_line_and_others_run_as_eager():
    torch.manual_seed(0)
    model = SamePad()
    captured = capture_model(model, torch.randn(2, 2, 8, 8))
    for shape in [(2, 2, 8, 8), (3, 2, 10, 12), (2, 2, 6, 4)]:       # even widths: the graph is the model
        x = torch.randn(shape)
        assert torch.equal(run_graph(captured, x), model(x))
    odd = torch.randn(2, 2, 9, 9)
    assert not torch.allclose(captured.graph(odd)[0], model(odd))   # what ran silently before
    with pytest.raises(UserError, match=r"x.size\(\)\[3\] % 2 == 0") as e:
        run_graph(captured, odd)
    assert "\n" not in str(e.value) and "capture the model on an example of these shapes" in str(e.value)


def test_fixed_and_bounded_dimensions_are_named_and_kept_through_the_capture_cache():
    torch.manual_seed(0)
    captured = capture_model(Positions(), torch.randn(2, 5))
    shapes = captured.input_shapes
    assert shapes is not None and shapes.ranges[str(shapes.dims["x"][1])] == (2, 6)
    reloaded = load_capture(dump_capture(captured), captured.module)
    assert reloaded.input_shapes == shapes and reloaded.input_guards is None      # the cache keeps the data
    for c in (captured, reloaded):
        run_graph(c, torch.randn(3, 6))
        with pytest.raises(UserError, match=r"has size 7 in dimension 1 \(\[2, 7\]\), but the model's graph was "
                                            r"captured for sizes 2\.\.6 there"):
            run_graph(c, torch.randn(2, 7))


def test_input_shapes_check_fixed_sizes_ranges_and_equal_dimensions():
    shapes = InputShapes(dims={"a": (2, "s0"), "b": ("s1", "s0", None)}, ranges={"s0": (3, 8), "s1": (2, None)},
                         paths={"a": "['a']", "b": "['b']"})
    shapes.check({"a": torch.zeros(2, 5), "b": torch.zeros(9, 5, 1), "c": torch.zeros(1)})
    assert InputShapes.from_json(shapes.to_json()) == shapes
    for values, message in [
            ({"a": torch.zeros(3, 5)}, r"\['a'\] has size 3 in dimension 0 .* fixed that dimension to the example's 2"),
            ({"a": torch.zeros(2, 9)}, r"has size 9 in dimension 1 .* captured for sizes 3\.\.8"),
            ({"a": torch.zeros(2, 4), "b": torch.zeros(2, 5, 1)}, r"\['b'\] has size 5 in dimension 1 but the input "
                                                                 r"at \['a'\]'s dimension 1 has 4"),
            ({"b": torch.zeros(2, 5)}, r"has 2 dimensions \(\[2, 5\]\), the model was captured with 3")]:
        with pytest.raises(UserError, match=message):
            shapes.check(values)
