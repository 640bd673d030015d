# The optional UCX data path. PSHARD_WITH_UCX is AUTO (use UCX when pkg-config
# finds it), ON (require it) or OFF. Afterwards PSHARD_WITH_UCX is ON or OFF
# (for config.h) and, when ON, PkgConfig::UCX is the target to link.
set(PSHARD_WITH_UCX AUTO CACHE STRING "Build the UCX transport: AUTO, ON or OFF")
set_property(CACHE PSHARD_WITH_UCX PROPERTY STRINGS AUTO ON OFF)
string(TOUPPER "${PSHARD_WITH_UCX}" pshard_ucx_request)

if(pshard_ucx_request STREQUAL "OFF")
  message(STATUS "UCX transport: off (PSHARD_WITH_UCX=OFF)")
  set(PSHARD_WITH_UCX OFF)
elseif(pshard_ucx_request STREQUAL "ON" OR pshard_ucx_request STREQUAL "AUTO")
  find_package(PkgConfig REQUIRED)
  pkg_check_modules(UCX IMPORTED_TARGET ucx)
  if(UCX_FOUND)
    message(STATUS "UCX transport: on (UCX ${UCX_VERSION})")
    set(PSHARD_WITH_UCX ON)
  elseif(pshard_ucx_request STREQUAL "ON")
    message(FATAL_ERROR "PSHARD_WITH_UCX=ON but pkg-config finds no 'ucx'; install libucx-dev "
                        "(or set PKG_CONFIG_PATH), or configure with -DPSHARD_WITH_UCX=AUTO or OFF")
  else()
    message(STATUS "UCX transport: off (pkg-config finds no 'ucx'; install libucx-dev to build it)")
    set(PSHARD_WITH_UCX OFF)
  endif()
else()
  message(FATAL_ERROR "PSHARD_WITH_UCX must be AUTO, ON or OFF, not '${PSHARD_WITH_UCX}'")
endif()
