"""objective.confidence_detach: the BCE term trains the confidence head alone. Checked in
float64 against two independent runs of the default path: the backbone's and the Markov
head's gradients are those of the loss without its BCE term (bce_weight 0), the confidence
head's those of the full loss; the loss value is unchanged."""

from __future__ import annotations

import pytest
import torch

from specforge_dspark.config.recipe import ObjectiveRecipe
from tests.test_objective import OBJ, anchors_for, make_batch, make_models, run, to64

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("chunk", [0, 3])
def test_detached_confidence_trains_only_its_head(chunk):
    draft, head = make_models()
    draft, head, batch = to64(draft, head, make_batch())
    anchors = anchors_for(batch, n=7)
    base = {**OBJ.__dict__, "num_anchors": 7, "chunk_size": chunk}
    loss_d, _, grads_d = run(
        draft, head, batch, anchors, ObjectiveRecipe(**{**base, "confidence_detach": True})
    )
    loss_f, _, grads_f = run(draft, head, batch, anchors, ObjectiveRecipe(**base))
    _, _, grads_0 = run(draft, head, batch, anchors, ObjectiveRecipe(**{**base, "bce_weight": 0.0}))
    torch.testing.assert_close(loss_d, loss_f, rtol=1e-12, atol=0)
    differs = 0
    for name, g in grads_d.items():
        want = grads_f[name] if name.startswith("confidence_head.") else grads_0[name]
        torch.testing.assert_close(g, want, rtol=1e-10, atol=1e-13, msg=name)
        differs += not torch.allclose(grads_f[name], grads_0[name])
    assert differs > 2  # the BCE does reach the backbone when not detached
