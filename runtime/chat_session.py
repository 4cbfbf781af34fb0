"""``python -m runtime DIR --chat`` without a prompt: an interactive chat in the terminal, as
llama.cpp's ``llama-cli -cnv`` and ``ollama run`` offer.

Each turn renders the whole conversation (the system message, every earlier turn and the new user
message) through the artifact's chat template and generates the assistant's answer, streamed as it
comes; the answer joins the history. When the conversation no longer fits the context with room for
an answer, the oldest turns are dropped (the system message stays) and a note says so. Ctrl-D (end
of input) or ``/exit`` ends the chat; ``/reset`` starts a new conversation.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from .errors import SkipDecodeError, first_line
from .generation_config import GenerationConfig

HELP = "Enter sends a message; /reset starts over, /exit or Ctrl-D ends the chat"


@dataclass
class ChatSession:
    """A conversation with ``gen`` through ``template`` (runtime.serve.chat.ChatTemplate)."""

    gen: object  # a runtime Generator
    template: object
    config: GenerationConfig
    system: str | None = None
    turns: list[dict] = field(default_factory=list)  # user and assistant messages, in order

    def prompt(self) -> tuple[str, int]:
        """The rendered conversation with the assistant's turn opened, dropping the oldest turns
        until it leaves room for ``max_new_tokens``; and how many messages were dropped."""
        head = [{"role": "system", "content": self.system}] if self.system is not None else []
        room = self.gen.max_length - self.config.max_new_tokens
        dropped = 0
        while True:
            text = self.template.render(head + self.turns)
            length = len(self.gen.tokenizer(text, add_special_tokens=False)["input_ids"])
            if length <= room or len(self.turns) <= 1:
                return text, dropped
            self.turns = self.turns[2:]  # the oldest user turn and its answer
            dropped += 2

    def ask(self, message: str, write=print) -> str:
        """One turn: ``message`` as the user's, the answer streamed to ``write`` as it comes."""
        self.turns.append({"role": "user", "content": message})
        text, dropped = self.prompt()
        if dropped:
            print(f"(the {dropped} oldest messages were dropped: the conversation outgrew the "
                  f"{self.gen.max_length} positions a row holds)", file=sys.stderr)
        result = self.gen.generate(text, config=self.config, logits=False,  # (the text alone is written)
                                   streamer=lambda event: write(event.texts[0], end="", flush=True))
        write()
        answer = result.texts[0].strip()
        self.turns.append({"role": "assistant", "content": answer})
        s = result.stats
        layers = f", {s.layer_reduction:.2f}x fewer layers" if s.layer_reduction > 1 else ""
        print(f"[{s.new_tokens} tokens, {s.decode_ms_per_token:.1f} ms/token, first after "
              f"{s.first_token_seconds * 1e3:.0f} ms{layers}]", file=sys.stderr)
        return answer


def run(session: ChatSession, read=input) -> int:
    """The chat loop: read a line, answer it, until end of input or /exit."""
    print(HELP, file=sys.stderr)
    while True:
        try:
            line = read("> ").strip()
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if not line:
            continue
        if line in ("/exit", "/quit", "/bye"):
            return 0
        if line in ("/reset", "/clear"):
            session.turns.clear()
            print("(a new conversation)", file=sys.stderr)
            continue
        try:
            session.ask(line)
        except SkipDecodeError as exc:  # a message past the context, say: the chat goes on without it
            session.turns.pop()
            print(f"error: {first_line(exc)}", file=sys.stderr)
