# SPDX-License-Identifier: Apache-2.0
# Install and export: `find_package(terrace)` gives terrace::terrace (the C++ static library) and
# terrace::c (libterrace.so, the C ABI). tests/consumer/ builds a separate project against the
# installed tree to prove it.
include(CMakePackageConfigHelpers)

set(TERRACE_INSTALL_CMAKEDIR "${CMAKE_INSTALL_LIBDIR}/cmake/terrace"
    CACHE STRING "Where terraceConfig.cmake is installed, relative to the prefix")
mark_as_advanced(TERRACE_INSTALL_CMAKEDIR)

# The in-tree names (terrace, terrace_c) are what the other CMakeLists use; the exported names are
# the ones a consumer sees, and they match the in-tree ALIAS targets so that a project embedding
# terrace with add_subdirectory() spells them the same way.
set_target_properties(terrace PROPERTIES EXPORT_NAME terrace)
# libterrace.so gets no SOVERSION: it is loaded by path (CUDAPluggableAllocator, ctypes), and a
# versioned file name would break every path that names libterrace.so.
set_target_properties(terrace_c PROPERTIES EXPORT_NAME c)

# Two export sets, one per package component: terrace::c (libterrace.so) has no usage
# requirements, so `find_package(terrace COMPONENTS c)` must not need what terrace::terrace needs
# (the CUDA toolkit, for CUDA::cudart_static, when this build has CUDA).
foreach(_terrace_export IN ITEMS "terrace;terraceTargets" "terrace_c;terraceCTargets")
  list(GET _terrace_export 0 _terrace_target)
  list(GET _terrace_export 1 _terrace_set)
  install(TARGETS ${_terrace_target}
    EXPORT ${_terrace_set}
    ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT terrace_development
    LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT terrace_runtime
            NAMELINK_COMPONENT terrace_development
    RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR} COMPONENT terrace_runtime
    # Each exported target must carry the include folder on its own. The top level's
    # $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}> is empty on a first configure
    # (GNUInstallDirs is included after it), so it cannot be relied on here.
    INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
  install(EXPORT ${_terrace_set}
    NAMESPACE terrace::
    FILE ${_terrace_set}.cmake
    DESTINATION ${TERRACE_INSTALL_CMAKEDIR}
    COMPONENT terrace_development)
endforeach()

# The whole public folder, detail/ included: public headers include it.
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/terrace
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
  COMPONENT terrace_development
  FILES_MATCHING PATTERN "*.hpp" PATTERN "*.h")

if(TERRACE_BUILD_TOOLS AND TARGET terrace_cli)
  install(TARGETS terrace_cli RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR} COMPONENT terrace_tools)
endif()

# The config must know whether this build linked CUDA::cudart_static into terrace::terrace: a
# consumer then needs find_dependency(CUDAToolkit) to resolve that imported target.
set(TERRACE_CONFIG_WITH_CUDA ${TERRACE_ENABLE_CUDA})
configure_package_config_file(
  ${CMAKE_CURRENT_LIST_DIR}/terraceConfig.cmake.in
  ${PROJECT_BINARY_DIR}/terraceConfig.cmake
  INSTALL_DESTINATION ${TERRACE_INSTALL_CMAKEDIR})
# Before 1.0 a minor release may break the API, so only the same major.minor is compatible.
write_basic_package_version_file(
  ${PROJECT_BINARY_DIR}/terraceConfigVersion.cmake
  VERSION ${PROJECT_VERSION}
  COMPATIBILITY SameMinorVersion)
install(FILES
  ${PROJECT_BINARY_DIR}/terraceConfig.cmake
  ${PROJECT_BINARY_DIR}/terraceConfigVersion.cmake
  DESTINATION ${TERRACE_INSTALL_CMAKEDIR}
  COMPONENT terrace_development)
