"""The fresh recording process of `isolated.FreshRecorder`: `python -m veosnap.runs.isolated_child`.

It answers one JSON request per line on stdin until stdin closes (the protocol is `isolated`'s docstring's).
A module of its own: it runs the recorder (`record.build_golden`, `record.judge_variants`), and the
recorder starts it through `isolated`.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

from ..errors import VeosnapError
from ..golden.key import GoldenKey
from ..reference.zoo import Project


def main() -> int:
    """The child: answer requests until stdin closes; nothing but answers goes to the channel."""
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever else prints (warnings, progress) goes to the log, not the channel
    sys.stdout = sys.stderr
    from ..candidates import pristine
    from ..golden import codec
    from .record import build_golden, certified, judge_variants

    for line in sys.stdin:
        request = json.loads(line)
        try:
            os.chdir(request.get("cwd", os.getcwd()))  # a reused child: where the caller is now
            project = Project(Path(request["goldens"]), Path(request["configs"]), Path(request["testdata"]),
                              request["hardware_class"])
            if request.get("given"):  # an existing golden to certify
                golden = codec.decode(Path(request["given"]).read_bytes(), request["given"])
                certified(project, golden)
            else:
                golden = build_golden(project, GoldenKey.from_name(request["key"]), seed=request["seed"],
                                      allow_near_ties=request["allow_near_ties"], sketch=request.get("sketch", "auto"))
            Path(request["out"]).write_bytes(codec.encode(golden))
            judged = judge_variants(project, golden) if request.get("judge") else []
            reply = {"ok": True, "judgments": [asdict(j) for j in judged]}
        except VeosnapError as exc:
            reply = {"error": str(exc)}
        except Exception as exc:  # noqa: BLE001 - reported to the parent in one line
            from ..errors import describe

            reply = {"error": f"{request.get('key')}: recording failed ({describe(exc)})"}
        reply["pristine"] = not pristine.touched()
        channel.write(json.dumps(reply) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
