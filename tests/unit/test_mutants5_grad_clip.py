"""AdaptiveGradClip's reciprocal mode under a ``max_norm`` below the adaptive threshold, from the fifth hand mutation
audit: the reciprocal clip value ``mean + z_t**2 / z * std`` lies above the norm for a norm under the adaptive
threshold (z < z_t), so without the ``min`` with ``max_norm`` such a norm went through unclipped past the ceiling;
the suite's reciprocal case had its outlier above both."""

from __future__ import annotations

import math

import pytest

from tests.unit._grad_clip_helpers import run_clip


def test_reciprocal_mode_still_caps_at_max_norm_below_the_adaptive_threshold() -> None:
    norms = [1.0 + 0.05 * math.sin(i) for i in range(30)] + [1.08]  # 1.08: above max_norm, z < z_threshold
    clip, _, seen = run_clip(norms, warmup_steps=25, mode="reciprocal", z_threshold=2.5, max_norm=1.06)
    assert seen[30][0] == 1.06 and seen[30][1] == pytest.approx(1.06, rel=1e-5)  # clipped to the threshold
    assert max(norms[:30]) < 1.06 and clip.clip_events == 1
