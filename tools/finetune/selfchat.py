"""``python -m tools.finetune.selfchat --model ART --out CSV``: chat data a model writes itself, to
self-distil a general chat model for skipping (``tools.finetune --distill``).

The model writes the requests: for each (kind, topic) pair of the lists below, one user turn asks
it for "a question about cooking, as a user would type it", sampled; then it answers each request
it wrote, through its chat template, sampled at full depth. Every byte of the result comes from
the model and the two lists here, so the data needs no download and carries no one else's
licence. The CSV's ``prompt`` is the rendered chat up to the assistant's turn and ``target`` the
answer (train with ``--separator ''``); answers cut at --max-new-tokens are dropped.
"""

from __future__ import annotations

import itertools
import random
import sys
from pathlib import Path

from runtime import cli

from .data import Example, write_csv

KINDS = (
    "a question about {topic}",
    "a request to explain {topic} simply",
    "a request for a very short story about {topic}",
    "a request for practical tips on {topic}",
    "a request to write a short email about {topic}",
    "a question comparing two things in {topic}",
    "a request for a list of ideas about {topic}",
    "a request for advice on a problem with {topic}",
)
TOPICS = (
    "cooking", "gardening", "travel in Europe", "personal finance", "learning a language", "history",
    "astronomy", "the human body", "exercise", "sleep", "pets", "music", "painting", "photography",
    "writing", "job interviews", "time management", "public speaking", "climate", "the ocean",
    "volcanoes", "electricity", "computers", "Python programming", "spreadsheets", "the internet",
    "smartphones", "cars", "bicycles", "trains", "cities", "architecture", "ancient Rome",
    "the Middle Ages", "philosophy", "economics", "chemistry", "physics", "biology", "mathematics",
    "geography", "weather", "birds", "insects", "trees", "coffee", "tea", "baking bread", "football",
    "chess", "board games", "films", "books", "poetry", "friendship", "parenting", "moving house",
    "saving energy at home", "first aid", "nutrition", "a birthday party", "a small business", "recycling",
    "space travel",
)
META = "Write {kind}, as a user would type it to an AI assistant. Write only that message, nothing else."


def requests(n: int, seed: int) -> list[str]:
    """``n`` meta-prompts, each (kind, topic) pair at most once, in a seeded order."""
    pairs = list(itertools.product(KINDS, TOPICS))
    random.Random(seed).shuffle(pairs)
    return [META.format(kind=kind.format(topic=topic)) for kind, topic in pairs[:n]]


def clean(text: str) -> str | None:
    """A written request as a user turn: its first paragraph, unquoted; None when it is not one."""
    text = text.strip().split("\n\n")[0].strip().strip('"').strip()
    return text if 10 <= len(text) <= 400 else None


def main(argv=None) -> int:
    p = cli.parser("python -m tools.finetune.selfchat", __doc__)
    p.add_argument("--model", required=True, help="artifact directory (python -m export build) of a chat model")
    p.add_argument("--out", required=True, help="CSV of (prompt, target) pairs to write")
    p.add_argument("--prompts", type=int, default=len(KINDS) * len(TOPICS),
                   help=f"requests to write, at most {len(KINDS) * len(TOPICS)} (default: all)")
    p.add_argument("--answers", type=int, default=1, help="sampled answers per request (default 1)")
    p.add_argument("--max-new-tokens", type=int, default=192, help="longest answer kept (default 192)")
    p.add_argument("--temperature", type=float, default=0.8, help="of the requests and answers (default 0.8)")
    p.add_argument("--batch-size", type=int, default=16, help="rows generated together (default 16)")
    p.add_argument("--threads", type=int, help="intra-op threads (default: the backend's)")
    p.add_argument("--seed", type=int, default=0, help="order of the requests and the sampling (default 0)")
    args = p.parse_args(argv)
    return cli.run(lambda: _run(args))


def _run(args) -> int:
    import runtime
    from runtime.errors import InvalidArgumentError
    from runtime.serve.chat import ChatTemplate

    if not 1 <= args.prompts <= len(KINDS) * len(TOPICS):
        raise InvalidArgumentError(f"--prompts {args.prompts}: between 1 and {len(KINDS) * len(TOPICS)} "
                                   f"(one per kind and topic of tools/finetune/selfchat.py)")
    with runtime.load(args.model, threads=args.threads, max_batch=args.batch_size) as gen:
        template = ChatTemplate.from_dir(Path(gen.directory) / gen.manifest.tokenizer_dir)
        if template is None:
            raise InvalidArgumentError(f"{args.model}: its tokenizer has no chat template, and selfchat "
                                       f"writes chats; pass the export of a chat (instruct) model")

        def chat(texts: list[str], seed: int) -> list[tuple[str, str, bool]]:
            """(rendered prompt, answer, finished) for each user turn, sampled at full depth."""
            rendered = [template.render([{"role": "user", "content": t}]) for t in texts]
            out = []
            for start in range(0, len(rendered), args.batch_size):
                batch = rendered[start:start + args.batch_size]
                r = gen.generate(batch, args.max_new_tokens, speedup=1, do_sample=True,
                                 temperature=args.temperature, top_p=0.95, seed=seed + start)
                out += [(p, t.strip(), reason == "eos") for p, t, reason in zip(batch, r.texts, r.finish_reasons)]
            return out

        written = [clean(text) for _, text, done in chat(requests(args.prompts, args.seed), args.seed) if done]
        users = [u for u in written if u]
        pairs = [Example(prompt, answer) for a in range(args.answers)
                 for prompt, answer, done in chat(users, args.seed + 1_000_003 * (a + 1)) if done and answer]
    if not pairs:
        raise InvalidArgumentError(f"{args.model} finished no answer within --max-new-tokens "
                                   f"{args.max_new_tokens}; raise it")
    write_csv(args.out, pairs)
    print(f"{len(users)} requests written (of {args.prompts} asked), {len(pairs)} finished answers -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
