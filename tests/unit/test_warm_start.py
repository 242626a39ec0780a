"""Validation through the training step's graphs (warm_start.ValidateAsTrained): speculators' validation loop calls
the draft under no_grad after eval(); the wrapper computes with grad on and in train mode, as a training step does
(so torch.compile's guards match), gives the same numbers, and hands back outputs that hold no graph. A draft with
dropout, or one FSDP shards, is validated speculators' way. (Stage 04's workers starting from a fork server, and
leaving nothing behind when it is killed: tests/reliability/test_lifeline.py.)"""
import torch

from eagle3pipe.train import warm_start


class Draft(torch.nn.Module):
    """A draft's call shape: (draft tokens, loss, metrics), recording the grad mode and train mode it ran under."""

    def __init__(self, dropout=0.0):
        super().__init__()
        torch.manual_seed(0)
        self.fc, self.drop, self.seen = torch.nn.Linear(8, 8), torch.nn.Dropout(dropout), []

    def forward(self, hidden_states):
        self.seen.append((torch.is_grad_enabled(), self.training))
        h = self.drop(self.fc(hidden_states))
        loss = h.square().mean()
        return [h.argmax(-1)], loss, {"loss_sum": loss, "h": h}


def speculators_validation(model, x):
    """What speculators' val_epoch does with the model it is given."""
    with torch.no_grad():
        model.eval()
        return model(hidden_states=x)


def test_validation_computes_as_training_does_and_keeps_no_graph():
    x = torch.randn(3, 8)
    plain, wrapped = Draft(), Draft()
    want = speculators_validation(plain, x)
    got = speculators_validation(warm_start.for_validation(wrapped), x)
    assert plain.seen == [(False, False)] and wrapped.seen == [(True, True)]  # the training step's guards
    assert wrapped.training  # eval() left train mode on
    assert torch.equal(got[0][0], want[0][0]) and torch.equal(got[1], want[1])
    assert torch.equal(got[2]["h"], want[2]["h"])
    for t in (got[0][0], got[1], got[2]["loss_sum"], got[2]["h"]):
        assert t.grad_fn is None and not t.requires_grad  # detached: the saved activations are freed
    assert warm_start.for_validation(wrapped).fc is wrapped.fc  # anything else is the model's own


def test_a_draft_with_dropout_or_sharded_is_validated_speculators_way():
    assert warm_start.for_validation(Draft(dropout=0.1)) is None
    assert warm_start.for_validation(Draft(), sharded=True) is None
    attn = Draft()
    attn.fc.attention_dropout = 0.1  # a transformers attention module's own dropout
    assert warm_start.for_validation(attn) is None
