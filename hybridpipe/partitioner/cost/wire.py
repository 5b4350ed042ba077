"""What one profiled byte costs on the wire in each precision.

Gradients are profiled as the parameters' float32 bytes and, in a 16-bit plan, all-reduced in
that dtype (``HybridDataParallel(wire_dtype=)``): :data:`WIRE_BYTES`. Activations cross between
stages in the dtype the forward computed them in (a transformer's float32 residual stream stays
float32 under autocast), so a profile taken in the plan's precision (``hybridpipe profile
--precision``) has already measured their wire bytes: :func:`activation_wire`.
"""

from __future__ import annotations

# what one profiled float32 byte of gradients costs on the wire in each precision
WIRE_BYTES = {"fp32": 1.0, "bf16": 0.5, "fp16": 0.5}


def activation_wire(precision: str, profile_precision: str) -> float:
    """Wire bytes per profiled activation byte for a ``precision`` plan of a ``profile_precision``
    profile: 1.0 when they agree (measured as the job runs); else the dtypes' size ratio, an
    estimate (an fp32 profile under bf16 assumes every activation crosses in 16 bits)."""
    return WIRE_BYTES[precision] / WIRE_BYTES[profile_precision]
