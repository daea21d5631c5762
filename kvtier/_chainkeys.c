/* Chained xxh3-128 page keys in one C loop: kvtier.hashing's key format, without a
 * Python-level step per page.
 *
 *   key[i] = XXH3_128(key[i-1] || page i's ids)
 *
 * A page is hashed as int32 little-endian when every id in it fits int32, else as
 * int64 little-endian (kvtier/hashing.py documents the format; tests check that
 * both implementations give the same bytes). The digest is XXH3_128's canonical
 * (big-endian) form, which is what python-xxhash's xxh3_128_digest returns.
 *
 * The hash itself is libxxhash's (xxhash.h from libxxhash-dev, or any xxHash >= 0.8
 * on the include path), inlined; this file only walks the pages.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#define KEY_BYTES 16

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
#define KV_BIG_ENDIAN 1
#else
#define KV_BIG_ENDIAN 0
#endif

/* Whether every id of the page fits int32. v fits iff (v + 2^31) mod 2^64 < 2^32; written as
 * adds, shifts and ors with no early exit, so the compiler vectorizes it (SSE2 has no 64-bit compare). */
static int fits_int32(const int64_t *page, Py_ssize_t n) {
    uint64_t wide = 0;
    for (Py_ssize_t j = 0; j < n; j++) wide |= ((uint64_t)page[j] + 0x80000000u) >> 32;
    return wide == 0;
}

/* The page's ids as little-endian int32 (narrow) or int64 at ``out``; returns the bytes written. */
static size_t put_page(unsigned char *out, const int64_t *page, Py_ssize_t n, int narrow) {
    if (narrow) {
        int32_t *o = (int32_t *)out; /* out is 16 bytes into a malloc'd block: aligned */
        for (Py_ssize_t j = 0; j < n; j++) o[j] = (int32_t)page[j];
        if (KV_BIG_ENDIAN)
            for (Py_ssize_t j = 0; j < n; j++) o[j] = (int32_t)__builtin_bswap32((uint32_t)o[j]);
        return 4 * (size_t)n;
    }
    memcpy(out, page, 8 * (size_t)n);
    if (KV_BIG_ENDIAN) {
        uint64_t *o = (uint64_t *)out;
        for (Py_ssize_t j = 0; j < n; j++) o[j] = __builtin_bswap64(o[j]);
    }
    return 8 * (size_t)n;
}

/* chain_xxh3_128(root: bytes, ids: int64 buffer, page_size: int) -> list[bytes]
 * One key per full page of ``ids`` (a C-contiguous buffer of native int64); the tail is ignored.
 * The hashing runs without the GIL: an engine's other threads keep going meanwhile. */
static PyObject *chain_xxh3_128(PyObject *self, PyObject *args) {
    Py_buffer root, ids;
    Py_ssize_t page_size;
    if (!PyArg_ParseTuple(args, "y*y*n", &root, &ids, &page_size)) return NULL;
    PyObject *out = NULL;
    unsigned char *buf = NULL, *keys = NULL;
    if (root.len != KEY_BYTES) {
        PyErr_Format(PyExc_ValueError, "root key must be %d bytes, got %zd", KEY_BYTES, root.len);
        goto done;
    }
    if (page_size <= 0 || ids.len % 8) {
        PyErr_SetString(PyExc_ValueError, "ids must be a contiguous int64 buffer and page_size > 0");
        goto done;
    }
    const int64_t *tok = (const int64_t *)ids.buf;
    Py_ssize_t full = (ids.len / 8) / page_size;
    buf = PyMem_RawMalloc(KEY_BYTES + 8 * (size_t)page_size);
    keys = PyMem_RawMalloc(KEY_BYTES * (size_t)(full ? full : 1));
    if (buf == NULL || keys == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    memcpy(buf, root.buf, KEY_BYTES);
    for (Py_ssize_t i = 0; i < full; i++) {
        const int64_t *page = tok + i * page_size;
        size_t len = KEY_BYTES + put_page(buf + KEY_BYTES, page, page_size, fits_int32(page, page_size));
        XXH128_canonical_t key;
        XXH128_canonicalFromHash(&key, XXH3_128bits(buf, len));
        memcpy(keys + KEY_BYTES * i, key.digest, KEY_BYTES);
        memcpy(buf, key.digest, KEY_BYTES); /* the next page chains over this key */
    }
    Py_END_ALLOW_THREADS
    out = PyList_New(full);
    if (out == NULL) goto done;
    for (Py_ssize_t i = 0; i < full; i++) {
        PyObject *b = PyBytes_FromStringAndSize((const char *)keys + KEY_BYTES * i, KEY_BYTES);
        if (b == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, i, b);
    }
done:
    PyMem_RawFree(buf);
    PyMem_RawFree(keys);
    PyBuffer_Release(&root);
    PyBuffer_Release(&ids);
    return out;
}

static PyMethodDef methods[] = {
    {"chain_xxh3_128", chain_xxh3_128, METH_VARARGS,
     "chain_xxh3_128(root, ids, page_size) -> list of 16-byte keys, one per full page of the int64 ids"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvtier._chainkeys", "Chained xxh3-128 page keys (see kvtier.hashing).", -1,
                                    methods};

PyMODINIT_FUNC PyInit__chainkeys(void) { return PyModule_Create(&module); }
