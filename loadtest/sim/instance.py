"""One simulated vLLM instance: continuous batching over paged KV.

Each engine step: running requests that need a new KV block for their next token
get one, preempting (by recompute, vLLM's default) the most recently admitted
request when none is free; then queued requests are admitted first come first
served while their blocks and the step's token budget allow (a head that does
not fit blocks the queue, as in vLLM); the step takes `profile.step_time` of
its tokens; at its end every request in it has one more token.

With prefix caching on, an admitted request prefills only the tokens its
instance's prefix cache lacks (loadtest/sim/prefix_cache.py).

Invariant: a running request holds blocks for tokens + 1 (its next token).
The instance also keeps the totals the proxy's ledger would: requests assigned,
their blocks (prompt + generated), and the tokens of those still waiting for
their first token here (a lite move's continuation counts its P + G), so views
are built in O(1). Each request records its worst gap between two tokens.
"""

from __future__ import annotations

from collections import deque

from loadtest.sim.prefix_cache import EngineCache, block_keys
from loadtest.sim.profile import Profile
from proxy.policy import Priority


class SimRequest:
    __slots__ = (
        "id",
        "arrival",
        "prompt",
        "output",
        "priority",
        "generated",
        "instance",
        "blocks",
        "running",
        "first_token",
        "finish",
        "preemptions",
        "preempted_at",
        "preempt_loss",
        "stall_until",
        "cut_to",
        "migrations",
        "demand",
        "queued",
        "awaiting_token",
        "klass",
        "last_token",
        "worst_gap",
        "prefix_group",
        "prefix_tokens",
        "session",
        "cached_tokens",
        "shared_blocks",
    )

    def __init__(
        self,
        id: int,
        arrival: float,
        prompt: int,
        output: int,
        priority: Priority,
        klass: Priority | None = None,
        prefix_group: int = -1,
        prefix_tokens: int = 0,
        session: int = -1,
    ) -> None:
        self.id, self.arrival, self.prompt, self.output = id, arrival, prompt, output
        self.priority = priority  # what the scheduler sees
        self.klass = priority if klass is None else klass  # the trace's class, for reports
        self.generated = 0
        self.instance: Instance | None = None
        self.blocks = 0  # KV blocks allocated on its instance
        self.running = False
        self.first_token: float | None = None
        self.finish: float | None = None
        self.preemptions = 0
        self.preempted_at: float | None = None
        self.preempt_loss = 0.0  # seconds between a preemption and re-admission
        self.stall_until = 0.0  # full-mode migration downtime
        # (mode, destination, tokens already copied): cut over at the next step end
        self.cut_to: tuple[str, Instance, int] | None = None
        self.migrations = 0
        self.demand = 0  # blocks counted in its instance's ledger total
        self.queued = 0  # tokens counted in its instance's queued total (no token there yet)
        self.awaiting_token = False  # assigned, and no token from that instance yet
        self.last_token: float | None = None  # when the previous token was produced
        self.worst_gap = 0.0  # longest wait between two of its tokens, seconds
        # Shared structure (loadtest/sim/prefix_cache.py): system prompt and session.
        self.prefix_group, self.prefix_tokens, self.session = prefix_group, prefix_tokens, session
        self.cached_tokens = 0  # found in the prefix cache at its last admission
        self.shared_blocks = 0  # of its prompt, cached where it was dispatched (not demand)

    @property
    def tokens(self) -> int:
        return self.prompt + self.generated


class Instance:
    def __init__(self, name: str, profile: Profile, prefix_caching: bool = False) -> None:
        self.name = name
        self.profile = profile
        self.bs = profile.block_size
        self.capacity = profile.kv_blocks
        # vLLM's prefix cache: an admitted request prefills only what it lacks.
        self.cache = EngineCache(profile.kv_blocks, profile.block_size) if prefix_caching else None
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.used = 0  # blocks allocated or reserved
        self.reserved: dict[int, int] = {}  # request id -> blocks held for an incoming copy
        self.busy = False
        self.batch: list[SimRequest] = []
        self.preemptions = 0
        self.healthy = True  # False while it starts (autoscaling): no dispatch yet
        self.draining = False  # autoscaling's scale-in: no dispatch, retired once empty
        # ledger totals
        self.count = 0
        self.demand = 0
        self.high = 0
        self.queued_tokens = 0
        self.awaiting = 0  # requests here with no token yet

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.bs)

    def ledger_blocks(self, r: SimRequest) -> int:
        """`r`'s blocks as the proxy's ledger counts them: less those it shares."""
        return max(0, self.blocks_for(r.tokens) - r.shared_blocks)

    @property
    def empty(self) -> bool:
        """Nothing assigned, running, queued or reserved here: it can be retired."""
        return not (self.count or self.busy or self.reserved or self.running or self.waiting)

    # ledger ---------------------------------------------------------------
    def assign(self, r: SimRequest, cached_tokens: int = 0) -> None:
        """Count `r` here as the proxy's ledger does; `cached_tokens` of it are in
        this instance's prefix cache as far as the prefix index knows."""
        r.instance = self
        r.shared_blocks = cached_tokens // self.bs
        r.demand = self.ledger_blocks(r)
        self.count += 1
        self.demand += r.demand
        r.queued = max(0, r.tokens - cached_tokens)
        self.queued_tokens += r.queued
        r.awaiting_token = True
        self.awaiting += 1
        if r.priority is Priority.HIGH:
            self.high += 1

    def unassign(self, r: SimRequest) -> None:
        self.count -= 1
        self.demand -= r.demand
        self.queued_tokens -= r.queued
        r.queued = 0
        if r.awaiting_token:
            r.awaiting_token = False
            self.awaiting -= 1
        if r.priority is Priority.HIGH:
            self.high -= 1
        r.instance = None

    # queue and batch --------------------------------------------------------
    def enqueue(self, r: SimRequest, cached_tokens: int = 0) -> None:
        self.assign(r, cached_tokens)
        self.waiting.append(r)

    def attach_running(self, r: SimRequest, stall_until: float) -> bool:
        """Full-mode arrival: the KV came along, no prefill. False if no room."""
        need = self.blocks_for(r.tokens + 1)
        if self.capacity - self.used < need:
            return False
        self.assign(r)
        self.used += need
        r.blocks, r.running, r.stall_until = need, True, stall_until
        self.running.append(r)
        return True

    def detach(self, r: SimRequest) -> None:
        """Take a request off this instance (finished, or moved), freeing its blocks."""
        if r.running:
            self.running.remove(r)
            r.running = False
        else:
            self.waiting.remove(r)
        self.used -= r.blocks
        r.blocks = 0
        self.unassign(r)

    def reserve(self, request_id: int, blocks: int) -> bool:
        if self.capacity - self.used < blocks:
            return False
        self.used += blocks
        self.reserved[request_id] = blocks
        return True

    def release(self, request_id: int) -> None:
        self.used -= self.reserved.pop(request_id, 0)

    def _preempt(self, victim: SimRequest, now: float) -> None:
        self.running.remove(victim)
        victim.running = False
        self.used -= victim.blocks
        victim.blocks = 0
        victim.preemptions += 1
        victim.preempted_at = now
        self.preemptions += 1
        self.waiting.appendleft(victim)

    def start_step(self, now: float) -> float | None:
        """Form the next batch; return its duration, or None when idle."""
        free = self.capacity - self.used
        # 1. Room for every running request's next token; preempt the newest if needed.
        i = 0
        while i < len(self.running):
            r = self.running[i]
            need = self.blocks_for(r.tokens + 1) - r.blocks
            while need > free and self.running:
                victim = self.running[-1]
                self._preempt(victim, now)
                free = self.capacity - self.used
                if victim is r:
                    break
            if r.running and need > 0:
                r.blocks += need
                self.used += need
                free -= need
            if r.running:
                i += 1
        # 2. Admit queued requests, first come first served.
        decoding = sum(1 for r in self.running if r.stall_until <= now)
        prefill = cached = 0
        budget = self.profile.max_batched_tokens
        admitted: list[SimRequest] = []
        while self.waiting and len(self.running) < self.profile.max_num_seqs:
            r = self.waiting[0]
            need = self.blocks_for(r.tokens + 1)
            if need > free or (admitted and decoding + prefill + r.tokens > budget):
                break
            self.waiting.popleft()
            r.blocks, r.running = need, True
            self.used += need
            free -= need
            r.cached_tokens = self.cache.admit(r, r.tokens) if self.cache is not None else 0
            prefill += r.tokens - r.cached_tokens
            cached += r.cached_tokens
            if r.preempted_at is not None:
                r.preempt_loss += now - r.preempted_at
                r.preempted_at = None
            self.running.append(r)
            admitted.append(r)
        self.batch = [r for r in self.running if r.stall_until <= now]
        if not self.batch:
            return None
        self.busy = True
        return self.profile.step_time(prefill, decoding, cached)

    def finish_step(self, now: float) -> tuple[list[SimRequest], list[SimRequest]]:
        """Credit one token to each request of the batch.
        Returns (finished requests, requests to cut over for migration)."""
        self.busy = False
        finished, cut = [], []
        for r in self.batch:
            if not r.running or r.instance is not self:
                continue
            r.generated += 1
            if r.first_token is None:
                r.first_token = now + self.profile.request_overhead_s
            elif r.last_token is not None:
                r.worst_gap = max(r.worst_gap, now - r.last_token)
            r.last_token = now
            if r.awaiting_token:
                r.awaiting_token = False
                self.awaiting -= 1
            if r.queued:
                self.queued_tokens -= r.queued
                r.queued = 0
            demand = self.ledger_blocks(r)
            if demand != r.demand:
                self.demand += demand - r.demand
                r.demand = demand
            if r.generated >= r.output:
                r.finish = now + self.profile.request_overhead_s
                if self.cache is not None:  # its answer heads its session's next turn
                    self.cache.insert(block_keys(r, r.tokens, self.bs))
                self.detach(r)
                finished.append(r)
            elif r.cut_to is not None:
                cut.append(r)
        self.batch = []
        return finished, cut
