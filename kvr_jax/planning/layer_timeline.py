"""The modelled timeline of a prefill's layers: every rank's steps (`Compute`, `Send`,
`Receive`, `Collective`, kvr_jax.runtime.roofline) run layer after layer by the rules in
kvr_jax/planning/costmodel.py's docstring, and stopped early once the rest is known
(`_SteadyState`). Pure Python: the partition search runs it tens of thousands of times."""

from __future__ import annotations

from collections.abc import Sequence

from kvr_jax.runtime.roofline import Collective, Compute, ModelledLayer, Receive, Send


def layer_timeline(
  layer: ModelledLayer | Sequence[ModelledLayer],
  num_layers: int,
  held_send: bool = False,
  intervals: list | None = None,
) -> list[float]:
  """When each rank finishes its last layer, running `layer`'s steps `num_layers` times (or
  a sequence of one description per layer, where layers differ: windows per layer), by the
  rules in the module docstring. With `intervals` (a list) it also appends every (rank,
  layer, phase, start, end): the computes, the sends on the sender's row, a "wait" where a
  rank waits for a message (or, held, for its own send to land)."""
  # The search runs this ~50k times per paper grid: the steps become plain tuples once.
  descriptions = [layer] * num_layers if isinstance(layer, ModelledLayer) else list(layer)
  if len(descriptions) != num_layers:
    raise ValueError(f"{len(descriptions)} modelled layers for {num_layers} layers")
  ops_of: dict[int, list] = {}
  for d in descriptions:
    if id(d) not in ops_of:  # once per description (setdefault would convert every layer)
      ops_of[id(d)] = [tuple(_as_op(step) for step in steps) for steps in d.steps]
  free = [0.0] * len(descriptions[0].steps)  # when each rank finished the previous layer
  link_free: dict[tuple[int, int], float] = {}  # when each link delivered its last message
  # Layers repeat_from..body_end are one description (usually all but the last, a model's
  # last layer, which reads one row: `last_layer`); the tail after them runs as it is.
  body_end = len(descriptions) - 1
  if body_end > 0 and descriptions[body_end] is not descriptions[body_end - 1]:
    body_end -= 1
  repeats_from = body_end
  while repeats_from > 0 and descriptions[repeats_from - 1] is descriptions[body_end]:
    repeats_from -= 1
  steady = _SteadyState() if intervals is None else None
  l = 0
  while l < len(descriptions):
    d = descriptions[l]
    # Watched only where a steady state would still skip two layers or more (its bookkeeping
    # costs about a layer's run).
    watched = steady is not None and repeats_from <= l and body_end - l >= 2
    sites = {} if watched else None
    free = _run_layer(ops_of[id(d)], free, link_free, held_send, l, intervals, sites)
    if sites is not None:
      advance = steady.advance(free, link_free, sites)
      if advance is not None:  # every later body layer advances every clock as this one did
        skipped = body_end - l
        rank_advance, link_advance = advance[: len(free)], advance[len(free) :]
        free = [t + skipped * a for t, a in zip(free, rank_advance, strict=True)]
        link_free = {
          key: t + skipped * a for (key, t), a in zip(link_free.items(), link_advance, strict=True)
        }
        steady = None
        l = body_end
    l += 1
  return free


# Advances (and gaps) closer than this, relative to the layer's largest advance, count as
# equal: float sums of the same phases differ in their last bits.
STEADY_TOLERANCE = 1e-9


class _SteadyState:
  """Tells when the rest of a timeline is known without running it.

  A layer is a max-plus map of the clocks (each rank's finish, each link's last delivery):
  every start is the max of some clocks plus constants, at its "sites" (a receive, a send,
  a barrier). Say layer l advanced every clock exactly as layer l-1 did (the advances d),
  and at every site no argument came closer to the maximum than it was in layer l-1. Then
  layer l+1, the same description, takes the same maximum at every site (its arguments move
  by the same d, so no gap shrinks) and advances every clock by d again, and so on: the
  finish of the last layer is this one's plus d per layer left. Ranks may advance at
  different rates (KV-Runahead's rank 0 never waits for anyone); what must hold is that no
  max changes its winner. The search runs the timeline tens of thousands of times; a
  32-layer model settles after a few layers."""

  def __init__(self):
    self.clocks = None  # the previous layer's clocks and sites, and its advances
    self.sites = None
    self.advances = None

  def advance(self, free, link_free, sites) -> list[float] | None:
    clocks = (list(free), dict(link_free))
    previous, previous_sites, previous_advances = self.clocks, self.sites, self.advances
    self.clocks, self.sites, self.advances = clocks, sites, None
    if previous is None or previous[1].keys() != link_free.keys():
      return None
    advances = [b - a for a, b in zip(previous[0], free, strict=True)]
    advances += [link_free[k] - previous[1][k] for k in link_free]
    self.advances = advances
    if previous_advances is None or previous_sites.keys() != sites.keys():
      return None
    tolerance = STEADY_TOLERANCE * max(max(abs(a) for a in advances), 1e-30)
    if any(abs(a - b) > tolerance for a, b in zip(advances, previous_advances, strict=True)):
      return None
    for key, arguments in sites.items():
      before = previous_sites[key]
      top, top_before = max(arguments), max(before)
      if any(
        (top - now) < (top_before - then) - tolerance
        for now, then in zip(arguments, before, strict=True)
      ):
        return None
    return advances  # the ranks' clocks', then the links' (in link_free's order)


_COMPUTE, _SEND, _RECEIVE, _COLLECTIVE = range(4)


def _as_op(step) -> tuple:
  if isinstance(step, Compute):
    return (_COMPUTE, step.phase, step.seconds, None)
  if isinstance(step, Send):
    return (_SEND, step.phase, step.seconds, step.to)
  if isinstance(step, Receive):
    return (_RECEIVE, "wait", 0.0, step.source)
  if isinstance(step, Collective):
    return (_COLLECTIVE, step.phase, step.seconds, None)
  raise TypeError(f"unknown modelled step {step!r}")


class _LayerMessages:
  """One layer's messages and barriers while its ranks advance. By link (sender, receiver):
  when each message landed, how many the receiver took, when it reached each of its receives
  there; when each rank reached the barrier. Each method returns the rank's clock after the
  step, or None where the step cannot run yet (the rank is retried later)."""

  def __init__(self, p, link_free, held_send, layer, intervals, sites):
    self.p, self.link_free, self.held_send, self.layer = p, link_free, held_send, layer
    self.out = intervals.append if intervals is not None else None
    self.sites = sites
    self.landings, self.taken, self.reached, self.at_barrier = {}, {}, {}, {}
    self.reached_new = False  # a receive was reached: a held send to it may go now

  def receive(self, i, step, t, other):
    link = (other, i)
    n = self.taken.get(link, 0)
    arrived = self.reached.setdefault(link, [])
    if len(arrived) == n:  # reached now (a blocked receive is retried)
      arrived.append(t)
      self.reached_new = True
    landed_times = self.landings.get(link, ())
    if len(landed_times) == n:
      return None
    landed = landed_times[n]
    self.taken[link] = n + 1
    if self.sites is not None:
      self.sites[(i, step)] = (t, landed)
    if self.out and landed > t:
      self.out((i, self.layer, "wait", t, landed))
    return max(t, landed)

  def send(self, i, step, t, phase, seconds, other):
    link = (i, other)
    sent = self.landings.setdefault(link, [])
    held = ()
    if self.held_send:  # its receiver must have reached the matching receive
      arrived = self.reached.get(link, ())
      if len(arrived) <= len(sent):
        return None
      held = (arrived[len(sent)],)
    # What the send's start waits for: the sender, the link, a held send's receiver.
    waits = (t, self.link_free.get(link, 0.0), *held)
    if self.sites is not None:  # what this max took
      self.sites[(i, step)] = waits
    start = max(waits)
    landed = self.link_free[link] = start + seconds
    sent.append(landed)
    if self.out:
      self.out((i, self.layer, phase, start, landed))
      if self.held_send:
        self.out((i, self.layer, "wait", t, landed))
    return landed if self.held_send else t  # a held sender waits until its message landed

  def collective(self, i, step, t, phase, seconds):
    """Every rank waits for the last to reach it."""
    self.at_barrier.setdefault(i, t)
    if len(self.at_barrier) < self.p:
      return None
    start = max(self.at_barrier.values())
    if self.sites is not None:
      self.sites[(i, step)] = tuple(self.at_barrier[j] for j in range(self.p))
    if self.out:
      self.out((i, self.layer, phase, start, start + seconds))
    return start + seconds


def _run_layer(ops, free, link_free, held_send, l, intervals, sites=None) -> list[float]:
  """One layer: every rank advanced as far as its messages and barriers let it, until all are
  done (steps depend only forwards). sites: gets each max's arguments by (rank, step).
  Messages on one link land in the order they were sent, and a rank's n-th receive from a
  source takes the n-th message of that link (a KV-Runahead full layer on its own split
  sends its hop and the hidden states' move over the same link)."""
  p = len(ops)
  now, at = list(free), [0] * p  # each rank's clock and its next step
  messages = _LayerMessages(p, link_free, held_send, l, intervals, sites)
  progress = True
  while progress:
    progress = False
    for i in range(p):
      rank_ops, t, step = ops[i], now[i], at[i]
      while step < len(rank_ops):
        kind, phase, seconds, other = rank_ops[step]
        if kind == _COMPUTE:
          if messages.out:
            messages.out((i, l, phase, t, t + seconds))
          after = t + seconds
        elif kind == _RECEIVE:
          after = messages.receive(i, step, t, other)
        elif kind == _SEND:
          after = messages.send(i, step, t, phase, seconds, other)
        else:
          after = messages.collective(i, step, t, phase, seconds)
        if messages.reached_new:
          messages.reached_new, progress = False, True
        if after is None:
          break
        t, step, progress = after, step + 1, True
      now[i], at[i] = t, step
  _check_done(ops, at)
  return now


def _check_done(ops, at) -> None:
  stuck = [i for i in range(len(ops)) if at[i] < len(ops[i])]
  if stuck:
    raise ValueError(f"the modelled layer deadlocks: ranks {stuck} wait on each other")
