"""The ping-pong GEMM's synchronisation (gemm_sm90.cu pingpong_gemm), modelled in Python with random
interleavings (no GPU): mbarrier phase parity, the slot ring, named barriers 1 and 2. Checks that every
consumer wait returns only when its slot holds the slice it wants, that nothing deadlocks, and that the
named barriers end balanced, over 1-7 tiles a CTA, 1-16 K slices a tile and 2-6 slots. Without the
named barriers the model fails (a warpgroup waits on a slot two phases early: parity aliasing).

    python tools/pingpong_protocol.py        (the CPU suite runs it too: tests/test_pingpong_protocol.py)
"""
import random


class MBar:
    def __init__(self, count):
        self.count, self.pending, self.completed = count, count, 0

    def arrive(self):
        self.pending -= 1
        if self.pending == 0:
            self.completed += 1
            self.pending = self.count

    def ready(self, parity):  # try_wait.parity: the phase of this parity has completed
        return (self.completed & 1) != parity


class Named:
    def __init__(self):
        self.arrived, self.gen = 0, 0

    def arrive(self):
        self.arrived += 128
        if self.arrived == 256:
            self.arrived, self.gen = 0, self.gen + 1


def run(tiles_cta, ksteps, stages, seed, delay=True, named_barriers=True):
    rng = random.Random(seed)
    full = [MBar(1) for _ in range(stages)]
    empty = [MBar(1) for _ in range(stages)]  # one arrival stands for the 4 warps of the consumer
    slot = [None] * stages
    inflight = []  # TMA copies issued, not landed: (slot, slice)
    named = {1: Named(), 2: Named()}
    log = []

    def producer():
        it = 0
        for t in range(tiles_cta):
            for ks in range(ksteps):
                st = it % stages
                if it >= stages:
                    while not empty[st].ready(((it // stages) - 1) & 1):
                        yield
                inflight.append((st, it))
                it += 1
                yield

    def consumer(wg):
        local = 0
        for t in range(tiles_cta):
            if (local & 1) != wg:
                local += 1
                continue
            if local > 0 and named_barriers:  # named_sync(1 + wg): arrive and wait for the generation to turn
                b = named[1 + wg]
                g = b.gen
                b.arrive()
                while b.gen == g:
                    yield
            it = local * ksteps
            for ks in range(ksteps):
                st = it % stages
                while not full[st].ready((it // stages) & 1):
                    yield
                assert slot[st] == it, f"wg{wg} waited on slice {it} but slot {st} holds {slot[st]}"
                log.append((wg, it))
                yield  # wgmma in flight; the previous slice is released after wait1
                if ks > 0:
                    empty[(it - 1) % stages].arrive()
                it += 1
            if t + 1 < tiles_cta and named_barriers:  # named_arrive(2 - wg): no wait
                named[2 - wg].arrive()
            yield
            empty[(it - 1) % stages].arrive()
            yield  # epilogue
            local += 1

    agents = [producer(), consumer(0), consumer(1)]
    done = [False] * 3
    stall = 0
    while not all(done):
        if inflight and (not delay or rng.random() < 0.5):  # a copy lands
            st, it = inflight.pop(0)
            slot[st] = it
            full[st].arrive()
            stall = 0
            continue
        i = rng.randrange(3)
        if done[i]:
            continue
        before = (len(log), len(inflight), sum(b.completed for b in empty), named[1].gen, named[2].gen,
                  named[1].arrived, named[2].arrived)
        try:
            next(agents[i])
        except StopIteration:
            done[i] = True
        after = (len(log), len(inflight), sum(b.completed for b in empty), named[1].gen, named[2].gen,
                 named[1].arrived, named[2].arrived)
        stall = 0 if after != before or done[i] else stall + 1
        if stall > 10000 and not inflight:
            raise RuntimeError(f"deadlock: tiles {tiles_cta}, ksteps {ksteps}, stages {stages}, done {done}")
    assert sorted(it for _, it in log) == list(range(tiles_cta * ksteps))
    assert named[1].arrived == 0 and named[2].arrived == 0, "a named barrier left half-arrived"


def check_all(seeds=range(30)):
    """Every (tiles, K slices, slots) case under each seed's interleaving (AssertionError or RuntimeError
    on the first that goes wrong)."""
    for tiles in range(1, 8):
        for ksteps in (1, 2, 3, 5, 6, 7, 16):
            for stages in (2, 3, 6):
                for seed in seeds:
                    run(tiles, ksteps, stages, seed)


if __name__ == "__main__":
    check_all()
    print("ok: no wrong slice, no deadlock, barriers balanced")
