// MIXPREC_API marks the public C++ API: libmixprec is built with hidden symbols by default
// (CMakeLists.txt), so only what the public headers annotate with it is exported.
#pragma once

// CMake defines MIXPREC_BUILDING_LIBRARY while compiling libmixprec itself (its DEFINE_SYMBOL);
// consumers never define it. Only Linux is built today; the Windows branch keeps the headers
// ready for it: a DLL exports what it defines and its users import it.
#if defined(_WIN32)
#if defined(MIXPREC_BUILDING_LIBRARY)
#define MIXPREC_API __declspec(dllexport)
#else
#define MIXPREC_API __declspec(dllimport)
#endif
#elif defined(__GNUC__) || defined(__clang__)
#define MIXPREC_API __attribute__((visibility("default")))
#else
#define MIXPREC_API
#endif
