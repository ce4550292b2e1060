// swaprl's pausable device memory: allocations whose physical memory can be released and restored at the same
// virtual addresses, so that pointers baked into captured CUDA graphs and kept in tensors stay valid across a pause.
//
// What it is: the allocation half of a PyTorch pluggable allocator. Each of kSlots pools has its own pair of
// entry points (swaprl_vmm_malloc_<k> / swaprl_vmm_free_<k>), which swaprl.kernels hands to
// torch.cuda.memory.CUDAPluggableAllocator and puts under a torch.cuda.MemPool: torch's caching allocator keeps
// doing the block splitting, caching and stream bookkeeping inside the pool and calls here only for whole
// segments. Every segment is its own CUDA virtual-memory allocation (cuMemAddressReserve + cuMemCreate + cuMemMap),
// so pausing a pool unmaps and releases the physical memory of all its segments while their address ranges stay
// reserved, and resuming maps fresh physical memory at the same addresses.
//
// Why this binding: it is the route PyTorch supports for routing a region of allocations to custom memory
// (MemPool + CUDAPluggableAllocator, also what vLLM's sleep-mode CuMemAllocator and torch_memory_saver's
// "torch" hook mode use), it works inside CUDA-graph capture (a capture given the pool's id allocates through it),
// and it needs no LD_PRELOAD. The library is plain C++ against the CUDA driver API (cuda.h, libcuda): no torch
// headers, so it builds in about a second with the host compiler and does not depend on torch's C++ ABI. The
// control functions below (pause, resume, counters) are called through ctypes.
//
// Contents: pausing releases memory without copying it, except the byte ranges the caller names, which are copied
// to the caller's (page-locked) host buffer first and copied back after the next resume. Python names the ranges
// of live tensors (the pool's allocated blocks) and leaves out free cached blocks and graph scratch memory.
//
// Sealed pools: a pool that torch no longer allocates from (no thread routes to it, no capture is given its id)
// only ever needs the memory under its live blocks. A resume with `kept_only` maps just the granules that hold the
// kept ranges, each run of them with its own physical allocation, and leaves the rest of the address range
// reserved but unbacked: torch still counts the free blocks there, but nothing will hand them out.
//
// Lent pages: an address range another allocator reserved (vLLM's sleep-mode pool) can be backed, while it is
// awake, by the physical pages under memory torch's caching allocator holds for the lender (free cached blocks it
// allocated for the purpose). Each page's handle is retained from torch's own mapping (cuMemRetainAllocationHandle)
// and mapped a second time at the engine's address; what is left of the range under a whole page gets physical
// memory of its own. Nothing is created or released for the pages: waking and sleeping then cost only mapping and
// unmapping, and the trainer finds its pages still mapped when the engine sleeps. The caller keeps torch's blocks
// allocated for as long as a range is lent from them.
//
// Thread safety: one mutex around all state; the CUDA calls run on the calling thread's current context (torch's
// primary context for the device), made current here when the thread has none.

#include <cuda.h>
#include <sys/types.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

constexpr int kSlots = 8;

// A run of a segment backed by one physical allocation.
struct Piece {
  size_t offset;
  size_t size;
  CUmemGenericAllocationHandle handle;
};

struct Segment {
  size_t size = 0;  // bytes reserved, a multiple of the device's granularity
  int device = 0;
  std::vector<Piece> pieces;  // what is backed now: the whole segment, a sealed pool's kept granules, or nothing
};

struct Saved {
  CUdeviceptr ptr;
  size_t size;
  size_t host_offset;
};

struct Slot {
  std::unordered_map<CUdeviceptr, Segment> segments;
  bool paused = false;
  std::vector<Saved> saved;  // ranges copied out by the last pause, copied back by the next resume
  char* host = nullptr;
  size_t reserved = 0;     // bytes of address space held
  size_t mapped = 0;       // bytes of physical memory held
  size_t granularity = 0;  // the device's allocation granularity (set by the first segment)
};

// A range backed by lent pages (retained handles) and, past the last whole page, memory of its own (created).
struct Lent {
  size_t size = 0;
  std::vector<Piece> pages;  // retained from torch's mappings
  std::vector<Piece> own;    // created here
};

std::mutex mu;
Slot slots[kSlots];
std::unordered_map<CUdeviceptr, Lent> lent;
size_t lent_page_bytes = 0;  // bytes of torch's pages mapped at lent ranges
size_t lent_own_bytes = 0;   // bytes of physical memory created for lent ranges' remainders
std::string last_error;

bool check(CUresult r, const char* what) {
  if (r == CUDA_SUCCESS) return true;
  const char* name = nullptr;
  cuGetErrorString(r, &name);
  last_error = std::string(what) + ": " + (name ? name : "unknown CUDA error");
  return false;
}

bool ensure_context(int device) {
  CUcontext ctx = nullptr;
  if (!check(cuCtxGetCurrent(&ctx), "cuCtxGetCurrent")) return false;
  if (ctx != nullptr) return true;
  CUdevice dev;
  if (!check(cuDeviceGet(&dev, device), "cuDeviceGet")) return false;
  if (!check(cuDevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain")) return false;
  return check(cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
}

CUmemAllocationProp properties(int device) {
  CUmemAllocationProp prop;
  std::memset(&prop, 0, sizeof(prop));
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  return prop;
}

// Back [base + offset, base + offset + size) with new physical memory on `device`, readable and writable from it.
bool map(CUdeviceptr base, Segment& seg, size_t offset, size_t size) {
  CUmemAllocationProp prop = properties(seg.device);
  CUmemGenericAllocationHandle handle;
  CUdeviceptr ptr = base + offset;
  if (!check(cuMemCreate(&handle, size, &prop, 0), "cuMemCreate")) return false;
  if (!check(cuMemMap(ptr, size, 0, handle, 0), "cuMemMap")) {
    cuMemRelease(handle);
    return false;
  }
  CUmemAccessDesc access;
  std::memset(&access, 0, sizeof(access));
  access.location = prop.location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  if (!check(cuMemSetAccess(ptr, size, &access, 1), "cuMemSetAccess")) {
    cuMemUnmap(ptr, size);
    cuMemRelease(handle);
    return false;
  }
  seg.pieces.push_back({offset, size, handle});
  return true;
}

// Release every piece of the segment's physical memory; returns the bytes released, or -1 (error set).
int64_t unmap(CUdeviceptr base, Segment& seg) {
  int64_t released = 0;
  while (!seg.pieces.empty()) {
    const Piece& p = seg.pieces.back();
    if (!check(cuMemUnmap(base + p.offset, p.size), "cuMemUnmap")) return -1;
    if (!check(cuMemRelease(p.handle), "cuMemRelease")) return -1;
    released += static_cast<int64_t>(p.size);
    seg.pieces.pop_back();
  }
  return released;
}

// Whether [ptr, ptr + size) lies in memory the segment at `base` backs now.
bool backed(CUdeviceptr base, const Segment& seg, CUdeviceptr ptr, size_t size) {
  for (const Piece& p : seg.pieces)
    if (ptr >= base + p.offset && ptr + size <= base + p.offset + p.size) return true;
  return false;
}

void* slot_malloc(int s, ssize_t size, int device) {
  std::lock_guard<std::mutex> guard(mu);
  Slot& slot = slots[s];
  if (slot.paused) {
    last_error = "allocation in a paused pool (resume it first)";
    return nullptr;
  }
  if (!check(cuInit(0), "cuInit") || !ensure_context(device)) return nullptr;
  CUmemAllocationProp prop = properties(device);
  size_t granularity = 0;
  if (!check(cuMemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
             "cuMemGetAllocationGranularity"))
    return nullptr;
  slot.granularity = granularity;
  Segment seg;
  seg.size = (static_cast<size_t>(size) + granularity - 1) / granularity * granularity;
  seg.device = device;
  CUdeviceptr ptr = 0;
  if (!check(cuMemAddressReserve(&ptr, seg.size, granularity, 0, 0), "cuMemAddressReserve")) return nullptr;
  if (!map(ptr, seg, 0, seg.size)) {  // out of memory, most likely: torch's allocator frees its cache and retries, or raises
    cuMemAddressFree(ptr, seg.size);
    return nullptr;
  }
  slot.segments[ptr] = seg;
  slot.reserved += seg.size;
  slot.mapped += seg.size;
  return reinterpret_cast<void*>(ptr);
}

void slot_free(int s, void* p) {
  std::lock_guard<std::mutex> guard(mu);
  Slot& slot = slots[s];
  auto ptr = reinterpret_cast<CUdeviceptr>(p);
  auto it = slot.segments.find(ptr);
  if (it == slot.segments.end()) return;
  Segment& seg = it->second;
  if (!seg.pieces.empty()) {
    // cudaFree waits for the device before it frees; unmapping does not, and work in flight may still use it.
    ensure_context(seg.device) && check(cuCtxSynchronize(), "cuCtxSynchronize");
    int64_t released = unmap(ptr, seg);
    if (released < 0) {
      std::fprintf(stderr, "swaprl vmm pool: freeing a segment failed (%s); its memory stays mapped\n",
                   last_error.c_str());
      return;
    }
    slot.mapped -= static_cast<size_t>(released);
  }
  cuMemAddressFree(ptr, seg.size);
  slot.reserved -= seg.size;
  slot.segments.erase(it);
}

// Whether [ptr, ptr + size) lies in memory one segment of the slot backs now.
bool inside(const Slot& slot, CUdeviceptr ptr, size_t size) {
  for (const auto& [base, seg] : slot.segments)
    if (ptr >= base && ptr + size <= base + seg.size) return backed(base, seg, ptr, size);
  return false;
}

// The granules of the segment at `base` that hold part of a saved range, as runs of (offset, size).
std::vector<std::pair<size_t, size_t>> kept_runs(CUdeviceptr base, const Segment& seg, const std::vector<Saved>& saved,
                                                 size_t granularity) {
  std::vector<std::pair<size_t, size_t>> runs;
  std::vector<bool> needed(seg.size / granularity, false);
  for (const Saved& r : saved) {
    if (r.ptr < base || r.ptr + r.size > base + seg.size || r.size == 0) continue;
    for (size_t g = (r.ptr - base) / granularity; g <= (r.ptr + r.size - 1 - base) / granularity; ++g) needed[g] = true;
  }
  for (size_t g = 0; g < needed.size(); ++g) {
    if (!needed[g]) continue;
    if (!runs.empty() && runs.back().first + runs.back().second == g * granularity)
      runs.back().second += granularity;
    else
      runs.push_back({g * granularity, granularity});
  }
  return runs;
}

// Unmap and let go of every piece of a lent range: the retained pages (torch still maps them) and the range's own
// memory. One unmap over the whole range when the driver takes it, else piece by piece. Every piece is let go even
// when one fails (a retry must not release a handle twice); returns false with the first error set.
bool unlend(CUdeviceptr dst, Lent& range) {
  size_t mapped = 0;
  for (const Piece& p : range.pages) mapped = std::max(mapped, p.offset + p.size);
  for (const Piece& p : range.own) mapped = std::max(mapped, p.offset + p.size);
  bool whole = mapped > 0 && cuMemUnmap(dst, mapped) == CUDA_SUCCESS;
  bool ok = true;
  std::string first;
  auto keep_first = [&](bool good) {
    if (!good && ok) first = last_error;
    ok = ok && good;
  };
  for (std::vector<Piece>* pieces : {&range.pages, &range.own})
    for (const Piece& p : *pieces)
      if (!whole) keep_first(check(cuMemUnmap(dst + p.offset, p.size), "cuMemUnmap"));
  for (const Piece& p : range.pages) {
    keep_first(check(cuMemRelease(p.handle), "cuMemRelease"));
    lent_page_bytes -= p.size;
  }
  for (const Piece& p : range.own) {
    keep_first(check(cuMemRelease(p.handle), "cuMemRelease"));
    lent_own_bytes -= p.size;
  }
  range.pages.clear();
  range.own.clear();
  if (!ok) last_error = first;
  return ok;
}

}  // namespace

extern "C" {

#define SWAPRL_SLOT(k)                                                                              \
  void* swaprl_vmm_malloc_##k(ssize_t size, int device, CUstream) { return slot_malloc(k, size, device); } \
  void swaprl_vmm_free_##k(void* ptr, ssize_t, int, CUstream) { slot_free(k, ptr); }

SWAPRL_SLOT(0)
SWAPRL_SLOT(1)
SWAPRL_SLOT(2)
SWAPRL_SLOT(3)
SWAPRL_SLOT(4)
SWAPRL_SLOT(5)
SWAPRL_SLOT(6)
SWAPRL_SLOT(7)

int swaprl_vmm_slots() { return kSlots; }

const char* swaprl_vmm_error() { return last_error.c_str(); }

// which: 0 = address space reserved, 1 = physical memory mapped, 2 = segments, 3 = paused (0/1).
uint64_t swaprl_vmm_stat(int s, int which) {
  std::lock_guard<std::mutex> guard(mu);
  if (s < 0 || s >= kSlots) return 0;
  const Slot& slot = slots[s];
  switch (which) {
    case 0: return slot.reserved;
    case 1: return slot.mapped;
    case 2: return slot.segments.size();
    case 3: return slot.paused ? 1 : 0;
    default: return 0;
  }
}

// Copy the n ranges (ptrs[i], sizes[i]) into `host` back to back, then release the physical memory of every
// segment of slot s. Returns 0, or -1 with swaprl_vmm_error() set; a failed pause leaves the pool as it was
// (mapped, nothing released) when the copies fail, and partly released when unmapping fails (not expected: the
// ranges are checked first).
int swaprl_vmm_pause(int s, const uint64_t* ptrs, const uint64_t* sizes, int n, void* host, uint64_t host_bytes,
                     int device) {
  std::lock_guard<std::mutex> guard(mu);
  if (s < 0 || s >= kSlots) {
    last_error = "no such pool slot";
    return -1;
  }
  Slot& slot = slots[s];
  if (slot.paused) return 0;
  if (!ensure_context(device)) return -1;
  std::vector<Saved> saved;
  size_t offset = 0;
  for (int i = 0; i < n; ++i) {
    if (!inside(slot, ptrs[i], sizes[i])) {
      last_error = "a range to keep is not inside the pool's mapped memory";
      return -1;
    }
    saved.push_back({ptrs[i], sizes[i], offset});
    offset += sizes[i];
  }
  if (offset > host_bytes) {
    last_error = "the host buffer is smaller than the ranges to keep";
    return -1;
  }
  // Nothing may still be using the memory once it is unmapped: wait for all work on the device.
  if (!check(cuCtxSynchronize(), "cuCtxSynchronize")) return -1;
  char* dst = static_cast<char*>(host);
  for (const Saved& r : saved)
    if (!check(cuMemcpyDtoHAsync(dst + r.host_offset, r.ptr, r.size, nullptr), "cuMemcpyDtoHAsync")) return -1;
  if (!check(cuStreamSynchronize(nullptr), "cuStreamSynchronize")) return -1;
  for (auto& [ptr, seg] : slot.segments) {
    int64_t released = unmap(ptr, seg);
    if (released < 0) return -1;
    slot.mapped -= static_cast<size_t>(released);
  }
  slot.saved = std::move(saved);
  slot.host = dst;
  slot.paused = true;
  return 0;
}

// Map new physical memory under every segment of slot s at its old address (with `kept_only`, under the granules
// that hold the kept ranges only: see "Sealed pools" above) and copy the kept ranges back. `fill` (0-255, or -1 for
// none) is written over the new memory first: what the pause did not keep then reads as that byte, not as whatever
// the physical memory held before. Returns 0, or -1 with swaprl_vmm_error() set; on failure (out of device memory)
// everything this call mapped is released again and the pool stays paused, its kept bytes still in the host buffer.
int swaprl_vmm_resume(int s, int device, int kept_only, int fill) {
  std::lock_guard<std::mutex> guard(mu);
  if (s < 0 || s >= kSlots) {
    last_error = "no such pool slot";
    return -1;
  }
  Slot& slot = slots[s];
  if (!slot.paused) return 0;
  if (!ensure_context(device)) return -1;
  auto undo = [&slot]() {
    std::string why = last_error;
    for (auto& [ptr, seg] : slot.segments) unmap(ptr, seg);
    last_error = why;
    return -1;
  };
  size_t mapped = 0;
  for (auto& [ptr, seg] : slot.segments) {
    std::vector<std::pair<size_t, size_t>> runs;
    if (kept_only)
      runs = kept_runs(ptr, seg, slot.saved, slot.granularity);
    else
      runs.push_back({0, seg.size});
    for (const auto& [offset, size] : runs) {
      if (!map(ptr, seg, offset, size)) return undo();
      if (fill >= 0 && !check(cuMemsetD8Async(ptr + offset, static_cast<unsigned char>(fill), size, nullptr),
                              "cuMemsetD8Async"))
        return undo();
      mapped += size;
    }
  }
  bool copied = true;
  for (const Saved& r : slot.saved)
    copied = copied && check(cuMemcpyHtoDAsync(r.ptr, slot.host + r.host_offset, r.size, nullptr),
                             "cuMemcpyHtoDAsync");
  copied = copied && check(cuStreamSynchronize(nullptr), "cuStreamSynchronize");
  if (!copied) return undo();
  slot.mapped += mapped;
  slot.saved.clear();
  slot.host = nullptr;
  slot.paused = false;
  return 0;
}

// Back the reserved range [dst, dst + size) with the n pages of `page` bytes that start at pages[i] (addresses in
// torch's memory, each the start of one physical allocation of that size), the i-th at dst + i * page, and the rest
// of the range with memory of its own; readable and writable from `device`. `fill` (0-255, or -1 for none) is
// written over the whole range, for memory that must not read as what torch left there. Returns 0, or -1 with
// swaprl_vmm_error() set and nothing mapped, retained or created.
int swaprl_vmm_lend(uint64_t dst, uint64_t size, const uint64_t* pages, int n, uint64_t page, int device, int fill) {
  std::lock_guard<std::mutex> guard(mu);
  if (lent.count(dst)) {
    last_error = "the range is lent already";
    return -1;
  }
  if (static_cast<uint64_t>(n) * page > size) {
    last_error = "more pages than the range holds";
    return -1;
  }
  if (!ensure_context(device)) return -1;
  Lent range;
  range.size = size;
  auto undo = [&]() {
    std::string why = last_error;
    unlend(dst, range);
    last_error = why;
    return -1;
  };
  for (int i = 0; i < n; ++i) {
    CUmemGenericAllocationHandle handle, last;
    if (!check(cuMemRetainAllocationHandle(&handle, reinterpret_cast<void*>(pages[i])),
               "cuMemRetainAllocationHandle"))
      return undo();
    // The page must be one physical allocation of `page` bytes: its last byte is backed by the same handle.
    if (!check(cuMemRetainAllocationHandle(&last, reinterpret_cast<void*>(pages[i] + page - 1)),
               "cuMemRetainAllocationHandle")) {
      cuMemRelease(handle);
      return undo();
    }
    cuMemRelease(last);
    // ... and it starts there: the byte before it is another allocation's, or none's (cuMemMap maps from offset 0).
    CUmemGenericAllocationHandle before = 0;
    bool starts = cuMemRetainAllocationHandle(&before, reinterpret_cast<void*>(pages[i] - 1)) != CUDA_SUCCESS;
    if (!starts) {
      starts = before != handle;
      cuMemRelease(before);
    }
    if (last != handle || !starts) {
      cuMemRelease(handle);
      last_error = "a lent page is not one physical allocation of the page size";
      return undo();
    }
    if (!check(cuMemMap(dst + i * page, page, 0, handle, 0), "cuMemMap")) {
      cuMemRelease(handle);
      return undo();
    }
    range.pages.push_back({i * page, page, handle});
    lent_page_bytes += page;
  }
  size_t rest = size - static_cast<size_t>(n) * page;
  if (rest) {
    CUmemAllocationProp prop = properties(device);
    CUmemGenericAllocationHandle handle;
    if (!check(cuMemCreate(&handle, rest, &prop, 0), "cuMemCreate")) return undo();
    if (!check(cuMemMap(dst + n * page, rest, 0, handle, 0), "cuMemMap")) {
      cuMemRelease(handle);
      return undo();
    }
    range.own.push_back({static_cast<size_t>(n) * page, rest, handle});
    lent_own_bytes += rest;
  }
  CUmemAccessDesc access;
  std::memset(&access, 0, sizeof(access));
  access.location = properties(device).location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  if (!check(cuMemSetAccess(dst, size, &access, 1), "cuMemSetAccess")) return undo();
  if (fill >= 0 && (!check(cuMemsetD8Async(dst, static_cast<unsigned char>(fill), size, nullptr), "cuMemsetD8Async") ||
                    !check(cuStreamSynchronize(nullptr), "cuStreamSynchronize")))
    return undo();
  lent[dst] = std::move(range);
  return 0;
}

// Unmap what swaprl_vmm_lend mapped at dst and let go of it (torch's pages stay mapped where torch maps them).
// Waits for the device first: work in flight may still read the range. Returns 0, 1 if nothing is lent there, or
// -1 with swaprl_vmm_error() set.
int swaprl_vmm_unlend(uint64_t dst, int device) {
  std::lock_guard<std::mutex> guard(mu);
  auto it = lent.find(dst);
  if (it == lent.end()) return 1;
  if (!ensure_context(device) || !check(cuCtxSynchronize(), "cuCtxSynchronize")) return -1;
  bool ok = unlend(dst, it->second);  // every piece let go, even when one failed: nothing is left to retry
  lent.erase(it);
  return ok ? 0 : -1;
}

// The bytes of the physical allocation mapped at `ptr` (the start of one), found by asking the driver which handle
// backs each granule after it, up to `limit` bytes; 0 if nothing is mapped there, -1 with swaprl_vmm_error() set.
int64_t swaprl_vmm_page_bytes(uint64_t ptr, uint64_t limit, int device) {
  std::lock_guard<std::mutex> guard(mu);
  if (!ensure_context(device)) return -1;
  CUmemAllocationProp prop = properties(device);
  size_t granularity = 0;
  if (!check(cuMemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
             "cuMemGetAllocationGranularity"))
    return -1;
  CUmemGenericAllocationHandle first;
  if (cuMemRetainAllocationHandle(&first, reinterpret_cast<void*>(ptr)) != CUDA_SUCCESS) return 0;
  uint64_t size = granularity;
  for (; size < limit; size += granularity) {
    CUmemGenericAllocationHandle next;
    if (cuMemRetainAllocationHandle(&next, reinterpret_cast<void*>(ptr + size)) != CUDA_SUCCESS) break;
    cuMemRelease(next);
    if (next != first) break;
  }
  cuMemRelease(first);
  return static_cast<int64_t>(size);
}

// which: 0 = torch's page bytes mapped at lent ranges, 1 = bytes created for their remainders, 2 = ranges lent.
uint64_t swaprl_vmm_lent_stat(int which) {
  std::lock_guard<std::mutex> guard(mu);
  switch (which) {
    case 0: return lent_page_bytes;
    case 1: return lent_own_bytes;
    case 2: return lent.size();
    default: return 0;
  }
}

}  // extern "C"
