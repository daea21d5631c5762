"""A seeded multi-turn chat workload: sessions that share system prompts and grow turn by turn.

Each request is a session's whole history so far (system prompt + every user
turn + every assistant reply), as chat serving re-sends it. Sessions are
interleaved round-robin, so by a session's next turn other sessions have
pushed its KV down the tiers: the later turns exercise host and storage hits.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class ChatWorkload:
    sessions: int = 8
    turns: int = 4
    system_prompts: int = 2
    system_tokens: int = 512
    user_tokens: int = 96
    reply_tokens: int = 64
    vocab_size: int = 2048
    seed: int = 0

    def requests(self) -> list[list[int]]:
        rng = random.Random(self.seed)

        def text(n: int) -> list[int]:
            return [rng.randrange(self.vocab_size) for _ in range(n)]

        systems = [text(self.system_tokens) for _ in range(self.system_prompts)]
        histories = [list(systems[s % self.system_prompts]) for s in range(self.sessions)]
        out = []
        for _turn in range(self.turns):
            for s in range(self.sessions):
                histories[s] += text(max(1, int(rng.uniform(0.5, 1.5) * self.user_tokens)))
                out.append(list(histories[s]))
                histories[s] += text(max(1, int(rng.uniform(0.5, 1.5) * self.reply_tokens)))
        return out
