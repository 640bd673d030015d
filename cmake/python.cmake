# The PyTorch bridge (python/): a pybind11 module over the client library,
# for the Python that has python3-torch (Debian's, /usr/bin/python3, unless
# PSHARD_PYTHON names another). PSHARD_WITH_PYTHON is AUTO (build it when
# pybind11 and that Python's headers are found), ON (require them) or OFF;
# afterwards it is ON or OFF. The fuzz build never builds it.
set(PSHARD_WITH_PYTHON AUTO CACHE STRING "Build the PyTorch bridge: AUTO, ON or OFF")
set_property(CACHE PSHARD_WITH_PYTHON PROPERTY STRINGS AUTO ON OFF)
set(PSHARD_PYTHON /usr/bin/python3 CACHE FILEPATH "The Python the bridge is built for")
string(TOUPPER "${PSHARD_WITH_PYTHON}" pshard_python_request)

if(pshard_python_request STREQUAL "OFF" OR PSHARD_WITH_FUZZERS)
  message(STATUS "PyTorch bridge: off")
  set(PSHARD_WITH_PYTHON OFF)
elseif(pshard_python_request STREQUAL "ON" OR pshard_python_request STREQUAL "AUTO")
  set(PYTHON_EXECUTABLE ${PSHARD_PYTHON})
  find_package(pybind11 CONFIG QUIET)
  if(pybind11_FOUND AND PYTHONLIBS_FOUND)
    message(STATUS "PyTorch bridge: on (pybind11 ${pybind11_VERSION}, ${PSHARD_PYTHON})")
    set(PSHARD_WITH_PYTHON ON)
  elseif(pshard_python_request STREQUAL "ON")
    message(FATAL_ERROR "PSHARD_WITH_PYTHON=ON but pybind11 or the headers of ${PSHARD_PYTHON} were not found; "
                        "install pybind11-dev and python3-dev, or configure with -DPSHARD_WITH_PYTHON=AUTO or OFF")
  else()
    message(STATUS "PyTorch bridge: off (pybind11-dev and python3-dev build it)")
    set(PSHARD_WITH_PYTHON OFF)
  endif()
else()
  message(FATAL_ERROR "PSHARD_WITH_PYTHON must be AUTO, ON or OFF, not '${PSHARD_WITH_PYTHON}'")
endif()
