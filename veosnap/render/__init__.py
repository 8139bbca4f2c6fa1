"""Reports for people and machines, drawn from the typed results of `runs`.

- `view`: the one view model (which lines and rows a report shows, decided once).
- `text`: the terminal (checks, diffs, the support matrix, one golden).
- `markdown`: a diff as a pull-request comment.
- `json`: one JSON document per command, every tensor listed.
- `html`: a check run as one self-contained page (charts per layer, route flips, worst rows).

Deciding stays in `view` (and in `runs`); the renderers only lay things out. Numbers are formatted in
one place, `numerics.fmt`.
"""
