"""Write stand-in RULER data files (essay haystack, SQuAD, HotpotQA) in RULER's formats, made-up text: only for
`DRY_RUN=1 bash benchmarks/leaderboard/reproduce.sh` on a machine without RULER's files, so that the 13-task commands
can be checked (samples built, plan printed) without a download. Never for a score: the text is not RULER's.

    python benchmarks/leaderboard/standin_data.py DIR
"""

import json
import sys
from pathlib import Path


def write(d: Path) -> None:
    d.mkdir(parents=True, exist_ok=True)
    essay = "".join(f"Stand-in essay sentence {i} is about startups and ideas. Why does it matter? It does! "
                    for i in range(3000))
    (d / "PaulGrahamEssays.json").write_text(json.dumps({"text": essay}))
    squad = {"data": [{"title": f"a{a}", "paragraphs": [
        {"context": f"Stand-in paragraph {a}-{p} of article {a} holds fact{a}x{p}. " * 6,
         "qas": [{"question": f"What does paragraph {a}-{p} hold?", "is_impossible": False,
                  "answers": [{"text": f"fact{a}x{p}"}]}]} for p in range(3)]} for a in range(60)]}
    (d / "squad.json").write_text(json.dumps(squad))
    hotpot = [{"question": f"Who wrote stand-in book {i}?", "answer": f"author{i}",
               "context": [[f"Title {i}-{j}", [f"Book {i}-{j} was written. ", f"By someone {j}."]] for j in range(10)]}
              for i in range(200)]
    (d / "hotpotqa.json").write_text(json.dumps(hotpot))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python benchmarks/leaderboard/standin_data.py DIR")
    write(Path(sys.argv[1]))
