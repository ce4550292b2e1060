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
// Thread safety: one mutex around all state; the CUDA calls run on the calling thread's current context (torch's
// primary context for the device), made current here when the thread has none.

#include <cuda.h>
#include <sys/types.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

constexpr int kSlots = 8;

struct Segment {
  size_t size = 0;  // bytes reserved and (when mapped) backed, a multiple of the device's granularity
  int device = 0;
  CUmemGenericAllocationHandle handle = 0;  // 0 while paused
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
  size_t reserved = 0;  // bytes of address space held
  size_t mapped = 0;    // bytes of physical memory held
};

std::mutex mu;
Slot slots[kSlots];
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

// Back [ptr, ptr + size) with new physical memory on `device`, readable and writable from it.
bool map(CUdeviceptr ptr, Segment& seg) {
  CUmemAllocationProp prop = properties(seg.device);
  CUmemGenericAllocationHandle handle;
  if (!check(cuMemCreate(&handle, seg.size, &prop, 0), "cuMemCreate")) return false;
  if (!check(cuMemMap(ptr, seg.size, 0, handle, 0), "cuMemMap")) {
    cuMemRelease(handle);
    return false;
  }
  CUmemAccessDesc access;
  std::memset(&access, 0, sizeof(access));
  access.location = prop.location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  if (!check(cuMemSetAccess(ptr, seg.size, &access, 1), "cuMemSetAccess")) {
    cuMemUnmap(ptr, seg.size);
    cuMemRelease(handle);
    return false;
  }
  seg.handle = handle;
  return true;
}

bool unmap(CUdeviceptr ptr, Segment& seg) {
  if (seg.handle == 0) return true;
  if (!check(cuMemUnmap(ptr, seg.size), "cuMemUnmap")) return false;
  if (!check(cuMemRelease(seg.handle), "cuMemRelease")) return false;
  seg.handle = 0;
  return true;
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
  Segment seg;
  seg.size = (static_cast<size_t>(size) + granularity - 1) / granularity * granularity;
  seg.device = device;
  CUdeviceptr ptr = 0;
  if (!check(cuMemAddressReserve(&ptr, seg.size, granularity, 0, 0), "cuMemAddressReserve")) return nullptr;
  if (!map(ptr, seg)) {  // out of memory, most likely: torch's allocator frees its cache and retries, or raises
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
  if (seg.handle != 0) {
    // cudaFree waits for the device before it frees; unmapping does not, and work in flight may still use it.
    ensure_context(seg.device) && check(cuCtxSynchronize(), "cuCtxSynchronize");
    if (!unmap(ptr, seg)) {
      std::fprintf(stderr, "swaprl vmm pool: freeing a segment failed (%s); its memory stays mapped\n",
                   last_error.c_str());
      return;
    }
    slot.mapped -= seg.size;
  }
  cuMemAddressFree(ptr, seg.size);
  slot.reserved -= seg.size;
  slot.segments.erase(it);
}

// The segment that holds [ptr, ptr + size), or nullptr.
const Segment* holder(const Slot& slot, CUdeviceptr ptr, size_t size) {
  for (const auto& [base, seg] : slot.segments)
    if (ptr >= base && ptr + size <= base + seg.size) return &seg;
  return nullptr;
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
    if (holder(slot, ptrs[i], sizes[i]) == nullptr) {
      last_error = "a range to keep is not inside the pool";
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
    if (seg.handle == 0) continue;
    if (!unmap(ptr, seg)) return -1;
    slot.mapped -= seg.size;
  }
  slot.saved = std::move(saved);
  slot.host = dst;
  slot.paused = true;
  return 0;
}

// Map new physical memory under every segment of slot s at its old address and copy the kept ranges back.
// Returns 0, or -1 with swaprl_vmm_error() set; on failure (out of device memory) everything this call mapped is
// released again and the pool stays paused, its kept bytes still in the host buffer.
int swaprl_vmm_resume(int s, int device) {
  std::lock_guard<std::mutex> guard(mu);
  if (s < 0 || s >= kSlots) {
    last_error = "no such pool slot";
    return -1;
  }
  Slot& slot = slots[s];
  if (!slot.paused) return 0;
  if (!ensure_context(device)) return -1;
  std::vector<CUdeviceptr> done;
  for (auto& [ptr, seg] : slot.segments) {
    if (!map(ptr, seg)) {
      std::string why = last_error;
      for (CUdeviceptr p : done) unmap(p, slot.segments[p]);
      last_error = why;
      return -1;
    }
    done.push_back(ptr);
  }
  bool copied = true;
  for (const Saved& r : slot.saved)
    copied = copied && check(cuMemcpyHtoDAsync(r.ptr, slot.host + r.host_offset, r.size, nullptr),
                             "cuMemcpyHtoDAsync");
  copied = copied && check(cuStreamSynchronize(nullptr), "cuStreamSynchronize");
  if (!copied) {
    std::string why = last_error;
    for (CUdeviceptr p : done) unmap(p, slot.segments[p]);
    last_error = why;
    return -1;
  }
  for (auto& [ptr, seg] : slot.segments) slot.mapped += seg.size;
  slot.saved.clear();
  slot.host = nullptr;
  slot.paused = false;
  return 0;
}

}  // extern "C"
