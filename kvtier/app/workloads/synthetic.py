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

    def system_texts(self) -> list[list[int]]:
        """The system prompts the sessions open with (session ``s``: prompt ``s mod system_prompts``)."""
        return self._systems(random.Random(self.seed))

    def _systems(self, rng: random.Random) -> list[list[int]]:
        return [[rng.randrange(self.vocab_size) for _ in range(self.system_tokens)] for _ in range(self.system_prompts)]

    def requests(self) -> list[list[int]]:
        rng = random.Random(self.seed)

        def text(n: int) -> list[int]:
            return [rng.randrange(self.vocab_size) for _ in range(n)]

        systems = self._systems(rng)
        histories = [list(systems[s % self.system_prompts]) for s in range(self.sessions)]
        out = []
        for _turn in range(self.turns):
            for s in range(self.sessions):
                histories[s] += text(max(1, int(rng.uniform(0.5, 1.5) * self.user_tokens)))
                out.append(list(histories[s]))
                histories[s] += text(max(1, int(rng.uniform(0.5, 1.5) * self.reply_tokens)))
        return out


@dataclass(frozen=True)
class ChatTrace:
    """Multi-turn conversations in the Mooncake trace format (512-token block ids, timestamps), all
    opening with the same system prompt: the shape of a chat service, for ``kvtier plan``.

    Conversations start at Poisson arrivals (``conversations_per_second``); each turn re-sends
    the whole history plus ``turn_blocks`` new blocks and a partial tail, ``think_seconds``
    (exponential) after the previous one."""

    conversations: int = 300
    turns: int = 6
    system_blocks: int = 1
    turn_blocks: int = 2
    tail_tokens: int = 100
    conversations_per_second: float = 2.0
    think_seconds: float = 20.0
    seed: int = 0

    def requests(self) -> list:
        from kvtier.app.workloads.mooncake import MOONCAKE_BLOCK_TOKENS, TraceRequest

        rng = random.Random(self.seed)
        system = list(range(self.system_blocks))
        next_id = self.system_blocks
        out = []
        start = 0.0
        for _ in range(self.conversations):
            start += rng.expovariate(self.conversations_per_second)
            t = start
            history = list(system)
            for _turn in range(self.turns):
                history += range(next_id, next_id + self.turn_blocks)
                next_id += self.turn_blocks
                out.append(TraceRequest(int(t * 1000), len(history) * MOONCAKE_BLOCK_TOKENS + self.tail_tokens, 64, tuple(history)))
                t += rng.expovariate(1.0 / self.think_seconds)
        out.sort(key=lambda r: r.timestamp_ms)
        return out
