"""Fair shares between client requests, so that one request's n sequences cannot crowd out the rest.

A client request with n > 1 becomes n scheduler requests (sequences) with one
`Request.client_request_id`. The scheduler's limits are the seats (`max_num_seqs`: the
sequences running) and each step's token budget. Counted per sequence, a request with
n = 128 would take 128 times what a request with one sequence gets, and a long prompt
would take every step's whole budget while the requests behind it wait. Here each client
request is one claimant, and a claimant's unused share passes on, so a request alone still
gets everything:

* Seats are shared max-min fairly (`water_fill`) among the client requests with running
  or waiting sequences. A request below its share takes the next free seat before the
  sequences of requests that have theirs (`next_waiting`); with no seat free, a request
  holding more than its share gives one back (`seats_to_free`). No request is cut below
  one seat, so requests of one sequence are never preempted for this.
* The token budget is shared max-min fairly among the running client requests plus the
  waiting line, as one more claimant that keeps its first-come order (`grant`). What the
  waiting line cannot use goes back to the running sequences held to their share
  (`pass_on`).
* Sequences run in rounds: every request's first before any request's second
  (`turn_key`), and within a request the one furthest behind goes first, so a request's
  sequences take turns inside its share. Under block pressure the newest sequence of the
  request holding the most seats goes first (`victim`).

With every request of one sequence, seats and turns order requests exactly as the
scheduler's plain (priority, arrival) order does; only a running prompt larger than its
share of the budget, while others wait, gives up the rest of the step to them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from cadence.scheduler.kv_cache_manager import BlockCopy, KVCacheManager
from cadence.scheduler.request import Request
from cadence.scheduler.step_chunks import ScheduledRequest, StepChunks


def water_fill(demands: Sequence[int], capacity: int) -> list[int]:
    """Max-min fair integer shares of `capacity`: no claimant gets more than it asks for,
    and none could get more without taking from one that has less. Where the capacity does
    not divide evenly, earlier claimants get the extra unit."""
    shares = [0] * len(demands)
    left = capacity
    # Smallest demands first; among equal ones the latest first, so the remainder of each
    # division lands on the earliest.
    order = sorted(range(len(demands)), key=lambda i: (demands[i], -i))
    for position, i in enumerate(order):
        shares[i] = min(demands[i], left // (len(order) - position))
        left -= shares[i]
    return shares


class FairShare:
    """One step's shares of seats and tokens between client requests (see the module doc).

    Built at the start of `Scheduler.schedule` from the running and waiting sequences; the
    scheduler tells it what it admits (`admitted`) and takes (`took`) as the step goes.
    """

    def __init__(self, running: list[Request], waiting: list[Request], max_num_seqs: int) -> None:
        self.max_num_seqs = max_num_seqs
        self.held: Counter[str] = Counter([r.client_request_id for r in running])
        self._turns: dict[str, int] = {}
        siblings: dict[str, list[Request]] = {}
        for request in running if len(self.held) < len(running) else []:
            if self.held[request.client_request_id] > 1:
                siblings.setdefault(request.client_request_id, []).append(request)
        for members in siblings.values():
            members.sort(key=lambda r: (r.num_tokens, r.arrival_seq))
            self._turns.update((r.request_id, turn) for turn, r in enumerate(members))
        self._waiting = waiting
        # Tokens each running client request may still take this step (None: no limit),
        # and what each sequence would take with no one else there.
        self._tokens_left: dict[str, int] | None = None
        self._demand: dict[str, int] = {}
        self._budget = 0

    # ----- seats ------------------------------------------------------------------------
    def seats_to_free(self, running: list[Request]) -> list[Request]:
        """Running sequences to preempt so that waiting requests below their share of the
        seats get one; the scheduler preempts them before anything else this step."""
        if not self._waiting or not any(count > 1 for count in self.held.values()):
            return []  # nobody holds a seat that could be given back
        wanted = Counter(self.held)
        wanted.update(r.client_request_id for r in self._waiting)
        priorities = {r.client_request_id: r.priority for r in running + self._waiting}
        ids = sorted(wanted, key=lambda c: priorities[c])
        shares = dict(zip(ids, water_fill([wanted[c] for c in ids], self.max_num_seqs)))
        free = self.max_num_seqs - len(running)
        victims: list[Request] = []
        for needy in ids:  # the most important first
            for _ in range(shares[needy] - self.held[needy]):
                if free > 0:
                    free -= 1
                    continue
                # Never from a more important request, and never a request's last seat.
                donors = [
                    c for c in self.held if self.held[c] > max(1, shares[c]) and priorities[c] >= priorities[needy]
                ]
                if not donors:
                    break
                donor = max(donors, key=lambda c: (self.held[c] - shares[c], priorities[c]))
                victims.append(self.victim([r for r in running if r.client_request_id == donor and r not in victims]))
        return victims

    def next_waiting(self, waiting: list[Request]) -> int:
        """Which waiting sequence to admit next: within the most important priority, the
        first whose request holds the fewest seats. With requests of one sequence that is
        always the first."""
        best, fewest = 0, self.held[waiting[0].client_request_id]
        for index, request in enumerate(waiting):
            if fewest == 0 or request.priority != waiting[0].priority:
                break
            if self.held[request.client_request_id] < fewest:
                best, fewest = index, self.held[request.client_request_id]
        return best

    def admitted(self, request: Request) -> None:
        self.held[request.client_request_id] += 1

    def victim(self, candidates: list[Request]) -> Request:
        """The sequence to preempt among `candidates`: of the least important priority, of
        the request holding the most seats, the newest. With requests of one sequence,
        simply the newest of the least important priority."""
        chosen = max(candidates, key=lambda r: (r.priority, self.held[r.client_request_id], r.arrival_seq))
        self.held[chosen.client_request_id] -= 1
        return chosen

    # ----- turns and tokens ---------------------------------------------------------------
    def turn_key(self, request: Request) -> tuple[int, int, int]:
        """The running order: priority, then rounds of one sequence per request."""
        return (request.priority, self._turns.get(request.request_id, 0), request.arrival_seq)

    def share_tokens(self, running: list[Request], chunks: StepChunks, budget: int, free_seats: int) -> None:
        """Split `budget` between the running requests (in `running`'s order) and the
        waiting line, each asking for the chunks its sequences would take alone."""
        demands = []
        for request in running:
            # A generating sequence asks for its one token. (All tokens but the computed
            # ones overstate only a prompt sent to another engine, by one, and that one
            # always has two or more left.)
            left = len(request.token_ids) - request.num_computed_tokens
            demands.append(left if left <= 1 else chunks.size(request, request.num_tokens_left, budget))
        waiting_asks = 0
        for request in self._waiting[:free_seats]:
            if waiting_asks >= budget:
                break
            # Capped prompts share one cap, which running ones take first: they ask nothing more.
            if not chunks.capped(request, request.num_tokens_left):
                waiting_asks += chunks.size(request, request.num_tokens_left, budget)
        self._budget = budget
        if sum(demands) + waiting_asks <= budget:
            self._tokens_left = None  # everyone gets all it asks for: the common case, kept cheap
            return
        self._demand = {r.request_id: demand for r, demand in zip(running, demands)}
        asked: Counter[str] = Counter()
        for request, demand in zip(running, demands):
            asked[request.client_request_id] += demand
        shares = water_fill([*asked.values(), waiting_asks], budget)
        self._tokens_left = dict(zip(asked, shares))

    def grant(self, request: Request) -> int:
        """The most tokens a running sequence may take now, before the waiting line."""
        if self._tokens_left is None:
            return self._budget
        return min(self._demand.get(request.request_id, 0), self._tokens_left.get(request.client_request_id, 0))

    def took(self, request: Request, num_tokens: int) -> None:
        if self._tokens_left is not None and request.client_request_id in self._tokens_left:
            self._tokens_left[request.client_request_id] -= num_tokens

    def pass_on(
        self, running: list[Request], scheduled: dict[str, ScheduledRequest], budget: int, kv_cache: KVCacheManager
    ) -> list[BlockCopy]:
        """Give what the waiting line left of the budget to the running sequences held to
        their share, in `running`'s order and never preempting for it; returns the block
        copies their new slots need."""
        copies: list[BlockCopy] = []
        for request in running if budget > 0 and self._tokens_left is not None else []:
            item = scheduled.get(request.request_id)
            done = item.num_new_tokens if item is not None else 0
            extra = min(self._demand.get(request.request_id, 0) - done, budget)
            # Capped prompts keep to the one cap they share (StepChunks).
            if extra <= 0 or StepChunks.capped(request, request.num_tokens_left):
                continue
            new_copies = kv_cache.allocate_slots(request, done + extra)
            if new_copies is None:
                break
            copies.extend(new_copies)
            scheduled[request.request_id] = ScheduledRequest(request, done + extra)
            budget -= extra
        return copies
