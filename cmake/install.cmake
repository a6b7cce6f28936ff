# Installation: headers, libraries, the tool, the package configuration
# (find_package(distopt)), pkg-config files, docs and license; and CPack's
# Debian package. `cmake --install build --prefix P`; scripts/package.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(DISTOPT_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/distopt)

install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/distopt DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
        COMPONENT dev FILES_MATCHING PATTERN "*.hpp" PATTERN "bench" EXCLUDE)
install(FILES ${PROJECT_BINARY_DIR}/include/distopt/version.hpp DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/distopt
        COMPONENT dev)

install(TARGETS distopt_lib distopt_static EXPORT distoptTargets
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT runtime NAMELINK_COMPONENT dev
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT dev
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(EXPORT distoptTargets NAMESPACE distopt:: DESTINATION ${DISTOPT_CMAKE_DIR} COMPONENT dev)
if(TARGET distopt_mpi)
  install(TARGETS distopt_mpi distopt_mpi_static EXPORT distoptMpiTargets
          LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT runtime NAMELINK_COMPONENT dev
          ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT dev)
  install(EXPORT distoptMpiTargets NAMESPACE distopt:: DESTINATION ${DISTOPT_CMAKE_DIR} COMPONENT dev)
endif()
install(TARGETS distopt RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR} COMPONENT runtime)

configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/distoptConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/distoptConfig.cmake INSTALL_DESTINATION ${DISTOPT_CMAKE_DIR})
# While 0.x, every minor version may change the API and ABI (the SONAME
# carries it): find_package(distopt 0.2) must not accept 0.3, so the
# minor version decides (SameMinorVersion); from 1.0 on, the major.
if(PROJECT_VERSION_MAJOR EQUAL 0)
  set(DISTOPT_COMPATIBILITY SameMinorVersion)
else()
  set(DISTOPT_COMPATIBILITY SameMajorVersion)
endif()
write_basic_package_version_file(${PROJECT_BINARY_DIR}/distoptConfigVersion.cmake
                                 COMPATIBILITY ${DISTOPT_COMPATIBILITY})
install(FILES ${PROJECT_BINARY_DIR}/distoptConfig.cmake ${PROJECT_BINARY_DIR}/distoptConfigVersion.cmake
        DESTINATION ${DISTOPT_CMAKE_DIR} COMPONENT dev)

# pkg-config: relocatable (prefix relative to the .pc file's folder).
set(DISTOPT_PC_DIR ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
file(RELATIVE_PATH DISTOPT_PC_TO_PREFIX /prefix/${DISTOPT_PC_DIR} /prefix)
string(REGEX REPLACE "/$" "" DISTOPT_PC_TO_PREFIX "${DISTOPT_PC_TO_PREFIX}")
configure_file(${PROJECT_SOURCE_DIR}/cmake/distopt.pc.in ${PROJECT_BINARY_DIR}/distopt.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/distopt.pc DESTINATION ${DISTOPT_PC_DIR} COMPONENT dev)
if(TARGET distopt_mpi)
  configure_file(${PROJECT_SOURCE_DIR}/cmake/distopt-mpi.pc.in ${PROJECT_BINARY_DIR}/distopt-mpi.pc @ONLY)
  install(FILES ${PROJECT_BINARY_DIR}/distopt-mpi.pc DESTINATION ${DISTOPT_PC_DIR} COMPONENT dev)
endif()

install(FILES ${PROJECT_SOURCE_DIR}/README.md ${PROJECT_SOURCE_DIR}/CHANGELOG.md
        DESTINATION ${CMAKE_INSTALL_DOCDIR} COMPONENT runtime)
install(FILES ${PROJECT_SOURCE_DIR}/LICENSE DESTINATION ${CMAKE_INSTALL_DOCDIR} RENAME copyright COMPONENT runtime)
install(DIRECTORY ${PROJECT_SOURCE_DIR}/docs/ DESTINATION ${CMAKE_INSTALL_DOCDIR}/docs COMPONENT runtime)

# The Debian package: everything in one package (tool, libraries, headers,
# CMake and pkg-config files); runtime dependencies from dpkg-shlibdeps.
set(CPACK_GENERATOR DEB)
set(CPACK_PACKAGE_NAME distopt)
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_PACKAGE_VENDOR "The distopt authors")
set(CPACK_PACKAGE_CONTACT "The distopt authors <maintainers@distopt.invalid>")
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "distributed optimizers: torch.optim-compatible rules, ZeRO sharding (C++20)")
set(CPACK_PACKAGE_DESCRIPTION
    "distopt is a C++20 library and command-line tool for training models with distributed optimizers: torch.optim-compatible optimizers, schedulers, SWA/EMA, clipping and loss scaling; DDP and ZeRO-1/2/3 sharding that stays exact; a threads backend and an MPI backend.")
set(CPACK_RESOURCE_FILE_LICENSE ${PROJECT_SOURCE_DIR}/LICENSE)
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
set(CPACK_DEBIAN_PACKAGE_SECTION science)
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
# Development use: the headers need nothing, the CMake package needs zlib's
# and (for the mpi component) Open MPI's development files.
set(CPACK_DEBIAN_PACKAGE_RECOMMENDS "dataset-fashion-mnist, fortunes, zlib1g-dev, libxxhash-dev")
set(CPACK_DEBIAN_PACKAGE_SUGGESTS "openmpi-bin, libopenmpi-dev")
include(CPack)
