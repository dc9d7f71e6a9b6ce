/* The one link send of the compiled planners: titan_ext.plan.timing.LinkQueues.send (DESIGN.md "Timing
 * model") in integer nanoseconds (int64), the one unit of plan/ (_pipemorph.c, _greedy.c, _search.c).
 *
 * A message ready at `ready` on a link direction ("channel") whose transmission window has length
 * `transfer` (size·β) and whose latency is `latency` (α):
 *   transfer == 0: it arrives at ready + latency, occupying nothing;
 *   else: its window starts at max(ready, *free_at) (first in, first out: after every message sent
 *   before it on the channel), *free_at becomes start + transfer (the window's end), and it arrives
 *   at start + transfer + latency (evaluated in that order: bit-identical to the Python copies).
 *
 * Header only (static inline): included by every C module of titan_ext/plan that sends a message;
 * setup.py lists it in the extensions' `depends` and pyproject.toml ships it.
 */
#ifndef TITAN_EXT_PLAN_LINK_H
#define TITAN_EXT_PLAN_LINK_H

#define TITAN_EXT_LINK_SEND(NAME, T)                                       \
    static inline T NAME(T *free_at, T transfer, T latency, T ready) {     \
        T start;                                                           \
        if (transfer == 0) return ready + latency;                         \
        start = ready > *free_at ? ready : *free_at;                       \
        *free_at = start + transfer;                                       \
        return start + transfer + latency;                                 \
    }

TITAN_EXT_LINK_SEND(link_send_ns, long long)

#undef TITAN_EXT_LINK_SEND

#endif
