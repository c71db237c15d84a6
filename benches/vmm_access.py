"""What CUDA's virtual memory calls cost by allocation size, outside Lanes.

Maps a range of 144 MiB (ResNet-50 bf16's ephemeral part at batch 8) as
allocations of 2, 16, 64 MiB or one of 144 MiB, then times one
`cuMemSetAccess` over it (median of 15), and the same with one call per
allocation or from several threads at once; then 1 GiB as 16 MiB or
256 MiB allocations. docs/switching.md, *Fewer allocations inside a
reservation*, quotes its output. Needs a GPU and its driver (libcuda);
nothing else:

    python3 benches/vmm_access.py
"""

import ctypes as C
import statistics as st
import threading
import time

cu = C.CDLL("libcuda.so.1")


def ck(r, what):
    if r != 0:
        raise RuntimeError(f"{what}: CUresult {r}")


class Loc(C.Structure):
    _fields_ = [("type", C.c_int), ("id", C.c_int)]


class AllocFlags(C.Structure):
    _fields_ = [
        ("compressionType", C.c_ubyte),
        ("gpuDirectRDMACapable", C.c_ubyte),
        ("usage", C.c_ushort),
        ("reserved", C.c_ubyte * 4),
    ]


class Prop(C.Structure):
    _fields_ = [
        ("type", C.c_int),
        ("requestedHandleTypes", C.c_int),
        ("location", Loc),
        ("win32HandleMetaData", C.c_void_p),
        ("allocFlags", AllocFlags),
    ]


class Access(C.Structure):
    _fields_ = [("location", Loc), ("flags", C.c_int)]


cu.cuMemCreate.argtypes = [C.POINTER(C.c_ulonglong), C.c_size_t, C.POINTER(Prop), C.c_ulonglong]
cu.cuMemAddressReserve.argtypes = [
    C.POINTER(C.c_ulonglong), C.c_size_t, C.c_size_t, C.c_ulonglong, C.c_ulonglong,
]
cu.cuMemMap.argtypes = [C.c_ulonglong, C.c_size_t, C.c_size_t, C.c_ulonglong, C.c_ulonglong]
cu.cuMemUnmap.argtypes = [C.c_ulonglong, C.c_size_t]
cu.cuMemSetAccess.argtypes = [C.c_ulonglong, C.c_size_t, C.POINTER(Access), C.c_size_t]

MIB = 1 << 20
DEVICE = 1  # CU_MEM_LOCATION_TYPE_DEVICE
PINNED = 1  # CU_MEM_ALLOCATION_TYPE_PINNED
READ_WRITE = 3  # CU_MEM_ACCESS_FLAGS_PROT_READWRITE


def main():
    ck(cu.cuInit(0), "cuInit")
    dev = C.c_int()
    ck(cu.cuDeviceGet(C.byref(dev), 0), "cuDeviceGet")
    ctx = C.c_void_p()
    ck(cu.cuDevicePrimaryCtxRetain(C.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    ck(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    prop = Prop()
    prop.type = PINNED
    prop.location = Loc(DEVICE, dev.value)
    acc = Access(Loc(DEVICE, dev.value), READ_WRITE)

    def run(total_mib, chunk_mib, mode, reps=15):
        n = total_mib // chunk_mib
        size = chunk_mib * MIB
        handles = []
        for _ in range(n):
            h = C.c_ulonglong()
            ck(cu.cuMemCreate(C.byref(h), size, C.byref(prop), 0), "cuMemCreate")
            handles.append(h.value)
        va = C.c_ulonglong()
        ck(cu.cuMemAddressReserve(C.byref(va), n * size, 0, 0, 0), "cuMemAddressReserve")
        va = va.value
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for i, h in enumerate(handles):
                ck(cu.cuMemMap(va + i * size, size, 0, h, 0), "cuMemMap")
            t1 = time.perf_counter()
            if mode == "one":
                ck(cu.cuMemSetAccess(va, n * size, C.byref(acc), 1), "cuMemSetAccess")
            elif mode == "each":
                for i in range(n):
                    ck(cu.cuMemSetAccess(va + i * size, size, C.byref(acc), 1), "cuMemSetAccess")
            else:  # "threadsK": K threads share the allocations
                k = int(mode[len("threads"):])

                def work(j):
                    cu.cuCtxSetCurrent(ctx)
                    for i in range(j, n, k):
                        ck(cu.cuMemSetAccess(va + i * size, size, C.byref(acc), 1), "cuMemSetAccess")

                threads = [threading.Thread(target=work, args=(j,)) for j in range(k)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
            t2 = time.perf_counter()
            times.append(((t1 - t0) * 1e6, (t2 - t1) * 1e6))
            for i in range(n):
                ck(cu.cuMemUnmap(va + i * size, size), "cuMemUnmap")
        maps = st.median([a for a, _ in times])
        access = st.median([b for _, b in times])
        print(
            f"{total_mib:5d} MiB as {n:3d} x {chunk_mib:4d} MiB {mode:9s}: "
            f"map {maps:7.1f} us  access {access:7.1f} us  ({access / n:5.1f} us/alloc)",
            flush=True,
        )

    for chunk in [2, 16, 64, 144]:
        run(144, chunk, "one")
    run(144, 16, "each")
    run(144, 16, "threads3")
    run(144, 16, "threads9")
    run(1024, 16, "one", reps=5)
    run(1024, 256, "one")


if __name__ == "__main__":
    main()
