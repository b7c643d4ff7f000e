// Work sharing for the CPU kernels. A kernel splits its work with conveyor::parallel_for: outside
// a decode team that is at::parallel_for (one OpenMP fork and join per call); inside one -- a single
// OpenMP parallel region around a whole decode step (decode_layers_cpu.cpp), whose threads meet at
// barriers between the step's phases -- the calling thread computes its own share of the same
// split, with no fork, no join and no allocation. At batch 1 a step runs ~150 small kernels (the
// demo model's matmuls stream 0.2-1.1 MB each), so the per-call costs were a fifth of the step.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

struct TeamScratch;   // kernels.h

namespace conveyor {

struct Team {
    int id;                 // this thread's index in the region
    int size;               // threads in the region
    TeamScratch* scratch;   // this thread's buffers, sized before the region
};

// The team of the calling thread, or null outside one (set by decode_layers for its region).
inline thread_local const Team* t_team = nullptr;

inline const Team* team() { return t_team; }

// f(b, e) over [begin, end) in chunks of at least `grain`, as at::parallel_for splits it (its
// OpenMP backend: min(threads, ceil(n / grain)) contiguous chunks); in a team, only this thread's chunk.
template <typename F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
    const Team* tm = t_team;
    if (!tm) {
        at::parallel_for(begin, end, grain, f);
        return;
    }
    if (begin >= end) return;
    const int64_t n = end - begin;
    const int64_t workers = std::min<int64_t>(tm->size, std::max<int64_t>(1, (n + std::max<int64_t>(grain, 1) - 1) /
                                                                                 std::max<int64_t>(grain, 1)));
    if (tm->id >= workers) return;
    const int64_t chunk = (n + workers - 1) / workers, b = begin + tm->id * chunk;
    if (b < end) f(b, std::min(end, b + chunk));
}

// Sets the calling thread's team for a scope.
struct TeamScope {
    explicit TeamScope(const Team* tm) { t_team = tm; }
    ~TeamScope() { t_team = nullptr; }
    TeamScope(const TeamScope&) = delete;
    TeamScope& operator=(const TeamScope&) = delete;
};

}  // namespace conveyor
