// Dropping a reference without the GIL. The last reference to a communicator
// joins its progress thread, which may at that moment be finishing a torch
// operation's callback and dropping a tensor whose Python object only its C++
// side still holds; torch takes the GIL to free that object. A thread that
// holds the GIL while it joins would wait forever (seen as a rank hung at exit
// after an abort, one run in twenty). Every path that may drop such a last
// reference from Python (an object's deallocation, a capsule's destructor,
// torch destroying the c10d backend) goes through releaseWithoutGil; the
// torch adapter includes this header too.
#pragma once

#include <pybind11/pybind11.h>

#include <memory>
#include <utility>

namespace clawcomm {

// p.reset(), with the GIL released meanwhile if this thread holds it.
template <typename Ptr>
void releaseWithoutGil(Ptr& p) {
  if (PyGILState_Check()) {
    pybind11::gil_scoped_release nogil;
    p.reset();
  } else {
    p.reset();
  }
}

// A reference to `*owned` for Python to hold: when Python drops the last one,
// `owned` is released without the GIL.
template <typename T>
std::shared_ptr<T> heldWithoutGil(std::shared_ptr<T> owned) {
  T* raw = owned.get();
  return std::shared_ptr<T>(raw,
                            [keep = std::move(owned)](T*) mutable { releaseWithoutGil(keep); });
}

}  // namespace clawcomm
