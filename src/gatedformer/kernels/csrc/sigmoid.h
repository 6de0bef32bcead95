// The scalar sigmoid shared by the recurrent cells (included inside the kernel's anonymous namespace,
// after simd.h). Needs <cmath>.
#pragma once

// The logistic function of a float or double, for the recurrent cells' scalar loops (which GCC vectorises).
template <typename T>
inline T sigmoid(T x) {
    const T e = std::exp(-std::fabs(x));  // never overflows
    const T inv = T(1) / (T(1) + e);
    return x >= T(0) ? inv : e * inv;
}
