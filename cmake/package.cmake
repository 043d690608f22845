# Install rules and the CMake package: `cmake --install BUILD --prefix PREFIX` puts the
# public headers, libweightstream.a, the `weightstream` command and
# lib/cmake/weightstream/ (weightstreamConfig.cmake, its version file and the exported
# target weightstream::weightstream), so that an outside project can
#   find_package(weightstream 0.1 REQUIRED)
#   target_link_libraries(app PRIVATE weightstream::weightstream)
# The library is static: its link interface names the libraries it was built against
# (OpenSSL, libcurl, pugixml, xxHash, liburing, UCX, CUDA's runtime), which
# weightstreamConfig.cmake finds again with find_dependency where they are CMake packages.
# Components: `library` (headers, library, package files) and `command`.
include(CMakePackageConfigHelpers)

set(WS_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/weightstream)

install(TARGETS weightstream EXPORT weightstreamTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT library)
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/weightstream
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR} COMPONENT library)
install(TARGETS weightstream_cli RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR} COMPONENT command)
install(EXPORT weightstreamTargets NAMESPACE weightstream:: DESTINATION ${WS_INSTALL_CMAKEDIR}
        COMPONENT library)

# What the config file must find again: the CMake packages behind the imported targets the
# library links (the other libraries appear in its link interface by their full paths).
set(WS_PACKAGE_PUGIXML OFF)
if(WS_PUGIXML MATCHES "^pugixml::")
  set(WS_PACKAGE_PUGIXML ON)
endif()
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/weightstreamConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/weightstreamConfig.cmake
                              INSTALL_DESTINATION ${WS_INSTALL_CMAKEDIR})
# 0.x: a minor version may break the API, so only the same minor version is compatible.
write_basic_package_version_file(${PROJECT_BINARY_DIR}/weightstreamConfigVersion.cmake
                                 COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/weightstreamConfig.cmake ${PROJECT_BINARY_DIR}/weightstreamConfigVersion.cmake
        DESTINATION ${WS_INSTALL_CMAKEDIR} COMPONENT library)
