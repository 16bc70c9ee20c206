/* shardrun._jsonlscan: the merge's hot loops in C (optional: shardrun falls back to pure Python without it).

scan(data, end, sigs, new_sigs, key, interned) reads the complete lines in data[:end] (each ending with '\n')
and, for each line, strictly validates it as one JSON object and reports:

  - where the line starts (its length follows from the next start, or from `end`);
  - a signature id: the row's shape, i.e. its top-level keys (raw bytes) with the JSON type of each value, and,
    when the row's "response" is an object whose "usage" is an object, the usage keys and value types. Ids come
    from the dict `sigs` (signature bytes -> id); a signature not yet in it is added with the next id, and
    (id, line number in this block) is appended to the list `new_sigs`, so the caller can parse that one line
    with a full JSON parser and decide what rows of this shape mean. -1 marks a line the caller must parse
    itself: anything this scanner does not take on with certainty (not an object, blank, invalid JSON, a
    key with an escape, a \\u escape of a surrogate, an integer of more than 15 digits, a float that over- or
    underflows, nesting deeper than MAX_DEPTH, "response" or "usage" or `key` twice, a number too long);
  - where its numbers start in `values`: every top-level number or bool (true 1.0, false 0.0) in key order,
    then every number or bool of response.usage in key order, as doubles. Integers have at most 15 digits, so
    every double holds its integer exactly;
  - with `key` (bytes, a top-level key without escapes): an id for the raw JSON text of that key's value,
    interned in the dict `interned` (value bytes -> id); -1 when the row has no such key.

Returns (lines, starts: bytes of int64, sig ids: bytes of int32, value starts: bytes of int64,
values: bytes of float64, key ids: bytes of int32 or None).

scatter(dst, src, src_offsets, lengths, dst_offsets) copies byte ranges src[so:so+n] to dst[do:do+n]
(offset and length arrays given as bytes of int64), checking every range against both buffers.
*/

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_DEPTH 256
#define MAX_NUMBER 64
#define MAX_INT_DIGITS 15

typedef struct {
    char *data;
    Py_ssize_t len, cap;
} Buf;

static int buf_reserve(Buf *b, Py_ssize_t extra) {
    if (b->len + extra <= b->cap)
        return 0;
    Py_ssize_t cap = b->cap ? b->cap : 4096;
    while (cap < b->len + extra)
        cap *= 2;
    char *p = PyMem_Realloc(b->data, cap);
    if (!p) {
        PyErr_NoMemory();
        return -1;
    }
    b->data = p;
    b->cap = cap;
    return 0;
}

static int buf_put(Buf *b, const void *src, Py_ssize_t n) {
    if (buf_reserve(b, n) < 0)
        return -1;
    memcpy(b->data + b->len, src, n);
    b->len += n;
    return 0;
}

/* ------------------------------------------------------------------ the validating parser */

/* Outcome of parsing one value: OK, or SLOW (the caller's full parser must decide; invalid JSON included). */
enum { OK = 0, SLOW = 1, NOMEM = 2 };

typedef struct {
    const unsigned char *p, *end;
    int depth;
} Cursor;

static inline void skip_ws(Cursor *c) {
    while (c->p < c->end && (*c->p == ' ' || *c->p == '\t' || *c->p == '\r' || *c->p == '\n'))
        c->p++;
}

static inline int hexval(unsigned char ch) {
    if (ch >= '0' && ch <= '9') return ch - '0';
    if (ch >= 'a' && ch <= 'f') return ch - 'a' + 10;
    if (ch >= 'A' && ch <= 'F') return ch - 'A' + 10;
    return -1;
}

/* One UTF-8 sequence starting at p (p[0] >= 0x80): its length, or 0 if invalid (overlong, surrogate, > U+10FFFF). */
static inline int utf8_len(const unsigned char *p, const unsigned char *end) {
    unsigned char a = p[0];
#define CONT(i) (p + (i) < end && (p[i] & 0xC0) == 0x80)
    if (a >= 0xC2 && a <= 0xDF)
        return CONT(1) ? 2 : 0;
    if (a == 0xE0)
        return (p + 1 < end && p[1] >= 0xA0 && p[1] <= 0xBF && CONT(2)) ? 3 : 0;
    if ((a >= 0xE1 && a <= 0xEC) || a == 0xEE || a == 0xEF)
        return (CONT(1) && CONT(2)) ? 3 : 0;
    if (a == 0xED)
        return (p + 1 < end && p[1] >= 0x80 && p[1] <= 0x9F && CONT(2)) ? 3 : 0;
    if (a == 0xF0)
        return (p + 1 < end && p[1] >= 0x90 && p[1] <= 0xBF && CONT(2) && CONT(3)) ? 4 : 0;
    if (a >= 0xF1 && a <= 0xF3)
        return (CONT(1) && CONT(2) && CONT(3)) ? 4 : 0;
    if (a == 0xF4)
        return (p + 1 < end && p[1] >= 0x80 && p[1] <= 0x8F && CONT(2) && CONT(3)) ? 4 : 0;
    return 0;
#undef CONT
}

/* Does any of the 8 bytes need a look: a quote, a backslash, a control character or a non-ASCII byte?
   (The usual SWAR tests; a false alarm can only follow a true one, and only sends us to the byte loop.) */
static inline int needs_look(uint64_t v) {
    const uint64_t ones = 0x0101010101010101ULL, high = 0x8080808080808080ULL;
    uint64_t quote = v ^ (ones * '"'), slash = v ^ (ones * '\\');
    return (((quote - ones) & ~quote) | ((slash - ones) & ~slash) | ((v - ones * 0x20) & ~v) | v) & high ? 1 : 0;
}

/* A string, c->p just past its opening quote; leaves c->p past the closing quote. *escaped tells if it had a
   backslash. */
static int parse_string(Cursor *c, int *escaped) {
    const unsigned char *p = c->p, *end = c->end;
    *escaped = 0;
    while (p < end) {
        uint64_t word;
        while (end - p >= 8) {
            memcpy(&word, p, 8);
            if (needs_look(word)) break;
            p += 8;
        }
        if (p >= end) break;
        unsigned char ch = *p;
        if (ch == '"') {
            c->p = p + 1;
            return OK;
        }
        if (ch == '\\') {
            *escaped = 1;
            if (p + 1 >= end) return SLOW;
            unsigned char e = p[1];
            if (e == 'u') {
                if (p + 5 >= end) return SLOW;
                int code = 0;
                for (int i = 2; i < 6; i++) {
                    int h = hexval(p[i]);
                    if (h < 0) return SLOW;
                    code = code * 16 + h;
                }
                if (code >= 0xD800 && code <= 0xDFFF) return SLOW;  /* surrogates: the full parser decides */
                p += 6;
            } else if (e == '"' || e == '\\' || e == '/' || e == 'b' || e == 'f' || e == 'n' || e == 'r' || e == 't') {
                p += 2;
            } else {
                return SLOW;
            }
        } else if (ch < 0x20) {
            return SLOW;
        } else if (ch >= 0x80) {
            int n = utf8_len(p, end);
            if (!n) return SLOW;
            p += n;
        } else {
            p++;
        }
    }
    return SLOW;
}

/* A number at c->p. *is_int: no fraction or exponent. *value: its double (exact for integers). */
static int parse_number(Cursor *c, double *value, int *is_int) {
    const unsigned char *start = c->p, *p = c->p, *end = c->end;
    int digits = 0;
    if (p < end && *p == '-') p++;
    if (p >= end) return SLOW;
    if (*p == '0') {
        p++;
        digits = 1;
    } else if (*p >= '1' && *p <= '9') {
        while (p < end && *p >= '0' && *p <= '9') {
            p++;
            digits++;
        }
    } else {
        return SLOW;
    }
    *is_int = 1;
    if (p < end && *p == '.') {
        *is_int = 0;
        p++;
        if (p >= end || *p < '0' || *p > '9') return SLOW;
        while (p < end && *p >= '0' && *p <= '9') p++;
    }
    if (p < end && (*p == 'e' || *p == 'E')) {
        *is_int = 0;
        p++;
        if (p < end && (*p == '+' || *p == '-')) p++;
        if (p >= end || *p < '0' || *p > '9') return SLOW;
        while (p < end && *p >= '0' && *p <= '9') p++;
    }
    Py_ssize_t n = p - start;
    if (*is_int) {
        if (digits > MAX_INT_DIGITS) return SLOW;
        int64_t v = 0;
        const unsigned char *q = start + (*start == '-');
        for (; q < p; q++) v = v * 10 + (*q - '0');
        *value = (double)(*start == '-' ? -v : v);
    } else {
        char tmp[MAX_NUMBER + 1];
        if (n > MAX_NUMBER) return SLOW;
        memcpy(tmp, start, n);
        tmp[n] = 0;
        errno = 0;
        char *stop;
        double d = strtod(tmp, &stop);
        if (stop != tmp + n || errno == ERANGE || !isfinite(d)) return SLOW;
        *value = d;
    }
    c->p = p;
    return OK;
}

typedef struct Row Row;
/* Called for each member of an object, c->p at the member's value (which it must consume). */
typedef int (*MemberFn)(Cursor *c, Row *row, const unsigned char *k, Py_ssize_t kn, int escaped);

static int parse_value(Cursor *c, char *type, double *num);

/* Into a container (c->p at its opening bracket): *more = 0 if it is empty (and then already left). */
static int open_container(Cursor *c, unsigned char close, int *more) {
    if (++c->depth > MAX_DEPTH) return SLOW;
    c->p++;
    skip_ws(c);
    *more = !(c->p < c->end && *c->p == close);
    if (!*more) {
        c->p++;
        c->depth--;
    }
    return OK;
}

/* After a member or element: a comma (*more = 1) or the closing bracket, which is left (*more = 0). */
static int after_item(Cursor *c, unsigned char close, int *more) {
    skip_ws(c);
    if (c->p >= c->end) return SLOW;
    if (*c->p != ',' && *c->p != close) return SLOW;
    *more = *c->p == ',';
    c->p++;
    if (*more)
        skip_ws(c);
    else
        c->depth--;
    return OK;
}

/* An object (c->p at its '{'), fn called for every member. */
static int walk_object(Cursor *c, Row *row, MemberFn fn) {
    int rc, more;
    if ((rc = open_container(c, '}', &more))) return rc;
    while (more) {
        int escaped;
        if (c->p >= c->end || *c->p != '"') return SLOW;
        const unsigned char *k = ++c->p;
        if ((rc = parse_string(c, &escaped))) return rc;
        Py_ssize_t kn = c->p - 1 - k;
        skip_ws(c);
        if (c->p >= c->end || *c->p != ':') return SLOW;
        c->p++;
        skip_ws(c);
        if ((rc = fn(c, row, k, kn, escaped)) || (rc = after_item(c, '}', &more))) return rc;
    }
    return OK;
}

static int any_member(Cursor *c, Row *row, const unsigned char *k, Py_ssize_t kn, int escaped) {
    char type;
    double num;
    return parse_value(c, &type, &num);
}

static int parse_array(Cursor *c) {
    int rc, more;
    if ((rc = open_container(c, ']', &more))) return rc;
    while (more) {
        char type;
        double num;
        if ((rc = parse_value(c, &type, &num)) || (rc = after_item(c, ']', &more))) return rc;
    }
    return OK;
}

static int literal(Cursor *c, const char *word, Py_ssize_t n) {
    if (c->end - c->p < n || memcmp(c->p, word, n)) return SLOW;
    c->p += n;
    return OK;
}

/* Any value at c->p. *type: n null, b bool, i int, f float, s string, a array, o object; *num for i, f, b. */
static int parse_value(Cursor *c, char *type, double *num) {
    if (c->p >= c->end) return SLOW;
    int is_int = 1, escaped;
    switch (*c->p) {
    case '"':
        *type = 's';
        c->p++;
        return parse_string(c, &escaped);
    case '{':
        *type = 'o';
        return walk_object(c, NULL, any_member);
    case '[':
        *type = 'a';
        return parse_array(c);
    case 't':
        *type = 'b';
        *num = 1.0;
        return literal(c, "true", 4);
    case 'f':
        *type = 'b';
        *num = 0.0;
        return literal(c, "false", 5);
    case 'n':
        *type = 'n';
        return literal(c, "null", 4);
    default: {
        int rc = parse_number(c, num, &is_int);
        *type = is_int ? 'i' : 'f';
        return rc;
    }
    }
}

/* ------------------------------------------------------------------ one row */

struct Row {
    Buf sig, values, usage_sig, usage_values;  /* usage's part goes after the top-level part, at the end */
    int has_usage;
    const char *key;
    Py_ssize_t key_len;
    const unsigned char *key_value;  /* raw text of `key`'s value, when found */
    Py_ssize_t key_value_len;
    int seen_response, seen_usage, seen_key;
};

static inline int is_key(const unsigned char *k, Py_ssize_t n, const char *word, Py_ssize_t wn) {
    return n == wn && memcmp(k, word, wn) == 0;
}

/* A member's key and type into a signature. */
static int sign(Buf *sig, const unsigned char *k, Py_ssize_t kn, char type) {
    if (buf_put(sig, k, kn) < 0 || buf_put(sig, "\0", 1) < 0 || buf_put(sig, &type, 1) < 0)
        return NOMEM;
    return OK;
}

static int usage_member(Cursor *c, Row *row, const unsigned char *k, Py_ssize_t kn, int escaped) {
    char type;
    double num;
    int rc = parse_value(c, &type, &num);
    if (rc || (rc = sign(&row->usage_sig, k, kn, type))) return rc;
    if ((type == 'i' || type == 'f' || type == 'b') && buf_put(&row->usage_values, &num, sizeof num) < 0)
        return NOMEM;
    return OK;
}

/* A member of the top-level "response" object: only "usage" is looked into. */
static int response_member(Cursor *c, Row *row, const unsigned char *k, Py_ssize_t kn, int escaped) {
    char type;
    double num;
    if (escaped) return SLOW;
    if (!is_key(k, kn, "usage", 5)) return parse_value(c, &type, &num);
    if (row->seen_usage++) return SLOW;
    if (c->p >= c->end || *c->p != '{') return parse_value(c, &type, &num);
    row->has_usage = 1;
    return walk_object(c, row, usage_member);
}

static int top_member(Cursor *c, Row *row, const unsigned char *k, Py_ssize_t kn, int escaped) {
    char type;
    double num;
    int rc;
    const unsigned char *v = c->p;
    if (escaped) return SLOW;
    if (is_key(k, kn, "response", 8)) {
        if (row->seen_response++) return SLOW;
        if (c->p < c->end && *c->p == '{') {
            type = 'o';
            rc = walk_object(c, row, response_member);
        } else {
            rc = parse_value(c, &type, &num);
        }
    } else {
        rc = parse_value(c, &type, &num);
    }
    if (rc || (rc = sign(&row->sig, k, kn, type))) return rc;
    if (row->key && is_key(k, kn, row->key, row->key_len)) {
        if (row->seen_key++) return SLOW;
        row->key_value = v;
        row->key_value_len = c->p - v;
    }
    if ((type == 'i' || type == 'f' || type == 'b') && buf_put(&row->values, &num, sizeof num) < 0)
        return NOMEM;
    return OK;
}

/* One line (without its newline): OK with row filled, or SLOW/NOMEM. */
static int parse_row(const unsigned char *line, const unsigned char *end, Row *row) {
    Cursor c = {line, end, 0};
    row->sig.len = row->values.len = row->usage_sig.len = row->usage_values.len = 0;
    row->has_usage = 0;
    row->key_value = NULL;
    row->seen_response = row->seen_usage = row->seen_key = 0;
    skip_ws(&c);
    if (c.p >= c.end || *c.p != '{') return SLOW;
    int rc = walk_object(&c, row, top_member);
    if (rc) return rc;
    skip_ws(&c);
    if (c.p != c.end) return SLOW;
    if (row->has_usage && (buf_put(&row->sig, "\x01", 1) < 0 ||
                           buf_put(&row->sig, row->usage_sig.data, row->usage_sig.len) < 0))
        return NOMEM;
    if (row->usage_values.len && buf_put(&row->values, row->usage_values.data, row->usage_values.len) < 0)
        return NOMEM;
    return OK;
}

/* ------------------------------------------------------------------ module functions */

static Py_ssize_t intern_bytes(PyObject *dict, const void *data, Py_ssize_t n) {
    PyObject *k = PyBytes_FromStringAndSize(data, n);
    if (!k) return -1;
    PyObject *id = PyDict_GetItemWithError(dict, k);
    Py_ssize_t out;
    if (id) {
        out = PyLong_AsSsize_t(id);
    } else if (PyErr_Occurred()) {
        out = -1;
    } else {
        out = PyDict_GET_SIZE(dict);
        PyObject *v = PyLong_FromSsize_t(out);
        if (!v || PyDict_SetItem(dict, k, v) < 0) out = -1;
        Py_XDECREF(v);
        if (out >= 0) out = -2 - out;  /* new: tell the caller (decoded below) */
    }
    Py_DECREF(k);
    return out;
}

static PyObject *scan(PyObject *self, PyObject *args) {
    Py_buffer view;
    Py_ssize_t end;
    PyObject *sigs, *new_sigs, *key, *interned;
    if (!PyArg_ParseTuple(args, "y*nO!O!OO", &view, &end, &PyDict_Type, &sigs, &PyList_Type, &new_sigs, &key,
                          &interned))
        return NULL;
    PyObject *result = NULL;
    Row row = {0};
    Buf starts = {0}, ids = {0}, vstarts = {0}, values = {0}, kids = {0};
    int want_key = key != Py_None;
    if (end < 0 || end > view.len) {
        PyErr_SetString(PyExc_ValueError, "end is outside the buffer");
        goto done;
    }
    if (want_key) {
        if (!PyBytes_Check(key) || !PyDict_Check(interned)) {
            PyErr_SetString(PyExc_TypeError, "key must be bytes and interned a dict");
            goto done;
        }
        row.key = PyBytes_AS_STRING(key);
        row.key_len = PyBytes_GET_SIZE(key);
    }
    const unsigned char *base = view.buf, *p = base, *stop = base + end;
    Py_ssize_t lines = 0;
    while (p < stop) {
        const unsigned char *nl = memchr(p, '\n', stop - p);
        const unsigned char *line_end = nl ? nl : stop;
        int64_t start = p - base, vstart = values.len / (Py_ssize_t)sizeof(double);
        int32_t id = -1, kid = -1;
        int rc = parse_row(p, line_end, &row);
        if (rc == NOMEM) goto done;
        if (rc == OK) {
            Py_ssize_t sid = intern_bytes(sigs, row.sig.data, row.sig.len);
            if (sid == -1) goto done;
            if (sid <= -2) {
                sid = -2 - sid;
                PyObject *pair = Py_BuildValue("(nn)", sid, lines);
                if (!pair || PyList_Append(new_sigs, pair) < 0) {
                    Py_XDECREF(pair);
                    goto done;
                }
                Py_DECREF(pair);
            }
            id = (int32_t)sid;
            if (buf_put(&values, row.values.data, row.values.len) < 0) goto done;
            if (want_key && row.key_value) {
                Py_ssize_t k = intern_bytes(interned, row.key_value, row.key_value_len);
                if (k == -1) goto done;
                kid = (int32_t)(k <= -2 ? -2 - k : k);
            }
        }
        if (buf_put(&starts, &start, sizeof start) < 0 || buf_put(&ids, &id, sizeof id) < 0 ||
            buf_put(&vstarts, &vstart, sizeof vstart) < 0 || (want_key && buf_put(&kids, &kid, sizeof kid) < 0))
            goto done;
        lines++;
        p = nl ? nl + 1 : stop;
    }
    result = Py_BuildValue("(ny#y#y#y#)", lines, starts.data ? starts.data : "", starts.len,
                           ids.data ? ids.data : "", ids.len, vstarts.data ? vstarts.data : "", vstarts.len,
                           values.data ? values.data : "", values.len);
    if (result) {
        PyObject *k = want_key ? PyBytes_FromStringAndSize(kids.data ? kids.data : "", kids.len) : Py_NewRef(Py_None);
        PyObject *full = k ? PyTuple_Pack(6, PyTuple_GET_ITEM(result, 0), PyTuple_GET_ITEM(result, 1),
                                          PyTuple_GET_ITEM(result, 2), PyTuple_GET_ITEM(result, 3),
                                          PyTuple_GET_ITEM(result, 4), k) : NULL;
        Py_XDECREF(k);
        Py_DECREF(result);
        result = full;
    }
done:
    PyBuffer_Release(&view);
    PyMem_Free(row.sig.data);
    PyMem_Free(row.values.data);
    PyMem_Free(row.usage_sig.data);
    PyMem_Free(row.usage_values.data);
    PyMem_Free(starts.data);
    PyMem_Free(ids.data);
    PyMem_Free(vstarts.data);
    PyMem_Free(values.data);
    PyMem_Free(kids.data);
    return result;
}

static PyObject *scatter(PyObject *self, PyObject *args) {
    Py_buffer dst, src, so, ln, dof;
    if (!PyArg_ParseTuple(args, "w*y*y*y*y*", &dst, &src, &so, &ln, &dof))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = so.len / (Py_ssize_t)sizeof(int64_t);
    if (so.len % sizeof(int64_t) || ln.len != so.len || dof.len != so.len) {
        PyErr_SetString(PyExc_ValueError, "offsets and lengths must be int64 arrays of one size");
        goto done;
    }
    const int64_t *s = so.buf, *l = ln.buf, *d = dof.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (l[i] < 0 || s[i] < 0 || d[i] < 0 || s[i] > src.len - l[i] || d[i] > dst.len - l[i]) {
            PyErr_Format(PyExc_ValueError, "range %zd is outside its buffer", i);
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++)
        memcpy((char *)dst.buf + d[i], (const char *)src.buf + s[i], l[i]);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    PyBuffer_Release(&so);
    PyBuffer_Release(&ln);
    PyBuffer_Release(&dof);
    return result;
}

static PyMethodDef methods[] = {
    {"scan", scan, METH_VARARGS, "Scan the complete JSON lines of a block (see the module's source)."},
    {"scatter", scatter, METH_VARARGS, "Copy byte ranges from one buffer into another."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_jsonlscan", NULL, -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__jsonlscan(void) { return PyModule_Create(&module); }
