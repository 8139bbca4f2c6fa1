"""Item 6: no input hook; a plugin that adapts the batch itself breaks the comparison.

    veosnap check --model llama --dtype float32 --backend examples/veomni/repro/item6_batch.py:collator_form

VeOmni's production batch is its collator's: padding removed, sequences concatenated in one row,
position ids restarting (its flash-attention path derives cu_seqlens from them). A plugin can only
get there by wrapping `forward`; it maps the logits back itself, but veosnap's layer-output hooks see
the packed [1, 86, H] tensors and main fails every `layers.N.output` on shape. (Under Ulysses SP the
batch is also sliced per rank and the labels pre-shifted: VeOmni's loss does not shift when
`sp_enabled`.)
"""


def collator_form(model):
    forward = model.forward

    def packed(input_ids=None, attention_mask=None, position_ids=None, labels=None, **kwargs):
        keep = attention_mask.bool()
        out = forward(input_ids=input_ids[keep][None], position_ids=position_ids[keep][None],
                      labels=None if labels is None else labels[keep][None], **kwargs)
        logits = out.logits.new_zeros(*input_ids.shape, out.logits.shape[-1])
        logits[keep] = out.logits[0]
        out.logits = logits
        return out

    model.forward = packed
    return model
