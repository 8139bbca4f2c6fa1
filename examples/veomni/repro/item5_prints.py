"""Item 5: a candidate that prints to stdout corrupts `--format json`.

    veosnap check --model llama --dtype float32 --backend examples/veomni/repro/item5_prints.py:chatty --format json | python -m json.tool

main: "Expecting value: line 1 column 1". VeOmni's logger writes its INFO lines to stdout (a handler made
at import), and importing its generated modeling files makes transformers print
`[ERROR] cache_position ... not documented` to stdout.
"""


def chatty(model):
    print("[INFO] building my model")
    model.register_forward_pre_hook(lambda *_: print("[INFO] forward"))
    return model
